"""Result kinds: the closed set of typed results a post stage may produce (classes, boxes with keypoints,
masks, text, scores), each in one module with its fields, check, compact form, fidelity and floors.

Pure (numpy). A new kind is one module with the members of `ResultKind` and its tests: the package finds
its modules (those with a NAME and FIELDS) and registers each one's declaration with `agent.vocabulary.kinds`,
from which the manifest's checks and the bundle schema's result block are derived. `add_kind` registers
one from elsewhere (a test's throwaway kind).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any, Mapping, Protocol, Sequence, cast

import numpy as np

from agent.errors import BundleError
from agent.proof.parity import Finding
from agent.vocabulary.kinds import Field, Floor, KindDecl, Option, register, unregister


class ResultKind(Protocol):
    """What every kind module holds (see docs/results.md)."""

    NAME: str
    FIELDS: tuple[Field, ...]
    DEFAULT_FLOORS: Mapping[str, float]
    READS: tuple[str, ...]  # result `type`s `normalise` accepts: its own, and the vocabulary's it maps to
    OPTIONS: tuple[Option, ...]  # postprocess.result keys read besides the fields, each with what it does
    FLOORS: tuple[Floor, ...]  # selftest.fidelity keys it judges by, with their defaults (= DEFAULT_FLOORS)
    DECODED: bool  # read from positions in a raw layout (boxes, masks, text): a decoder needs package answers

    def check(self, tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]: ...

    def compact(self, tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
                charset: Sequence[str] = ()) -> dict[str, Any]: ...

    def normalise(self, result: Mapping[str, Any]) -> object: ...

    def fidelity(self, served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
                 floors: Mapping[str, Any] | None = None, stage: str = "post"
                 ) -> tuple[dict[str, Any], list[Finding]]: ...

    def golden_warnings(self, answers: Sequence[Mapping[str, Any]]) -> list[str]: ...


KINDS: dict[str, ResultKind] = {}


def declaration(kind: ResultKind) -> KindDecl:
    """What the manifest and the bundle schema know of a kind, from the module's own constants."""
    vocabulary = next((r for r in kind.READS if r != kind.NAME), None)
    doc = ((getattr(kind, "__doc__", None) or "").strip().splitlines() or [""])[0]
    return KindDecl(kind.NAME, kind.FIELDS, kind.OPTIONS, kind.FLOORS, vocabulary, doc, kind.DECODED)


def add_kind(kind: ResultKind) -> None:
    """Register a kind module (its behaviour here, its declaration with agent.vocabulary.kinds)."""
    register(declaration(kind))
    KINDS[kind.NAME] = kind


def remove_kind(name: str) -> None:
    """Forget a kind added by `add_kind` (a test's throwaway kind)."""
    KINDS.pop(name, None)
    unregister(name)


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module: ModuleType = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "FIELDS"):
            add_kind(cast(ResultKind, module))


_discover()


def kind_for(name: str) -> ResultKind:
    """The kind called `name`, or an error naming the known kinds."""
    try:
        return KINDS[name]
    except KeyError:
        raise BundleError(f"key postprocess.result.kind: unknown result kind {name!r} "
                          f"(known: {', '.join(sorted(KINDS))})") from None


def kind_reading(result_type: str) -> ResultKind | None:
    """The kind whose `normalise` reads results of this `type` (a kind's own, or a vocabulary task's)."""
    return next((k for k in KINDS.values() if result_type in k.READS), None)
