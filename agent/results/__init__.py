"""Result kinds: the closed set of typed results a post stage may produce (classes, boxes with keypoints,
masks, text, scores), each in one module with its fields, check, compact form, fidelity and floors.

Pure (numpy). A new kind is one module with the members of `ResultKind` and its tests, added to `_MODULES`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from agent.errors import BundleError
from agent.proof.parity import Finding
from agent.results import boxes, classes, masks, scores, text
from agent.results.fields import Field


class ResultKind(Protocol):
    """What every kind module holds (see docs/results.md)."""

    NAME: str
    FIELDS: tuple[Field, ...]
    DEFAULT_FLOORS: Mapping[str, float]
    READS: tuple[str, ...]  # result `type`s `normalise` accepts: its own, and the vocabulary's it maps to
    OPTIONS: Mapping[str, str]  # postprocess.result keys read besides the fields, each with what it does

    def check(self, tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]: ...

    def compact(self, tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
                charset: Sequence[str] = ()) -> dict[str, Any]: ...

    def normalise(self, result: Mapping[str, Any]) -> object: ...

    def fidelity(self, served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
                 floors: Mapping[str, Any] | None = None, stage: str = "post"
                 ) -> tuple[dict[str, Any], list[Finding]]: ...

    def golden_warnings(self, answers: Sequence[Mapping[str, Any]]) -> list[str]: ...


# The one list a new kind is added to; mypy checks each module against ResultKind here.
_MODULES: tuple[ResultKind, ...] = (classes, boxes, masks, text, scores)

KINDS: dict[str, ResultKind] = {m.NAME: m for m in _MODULES}


def kind_for(name: str) -> ResultKind:
    """The kind called `name`, or an error naming the known kinds."""
    try:
        return KINDS[name]
    except KeyError:
        raise BundleError(f"key postprocess.result.kind: unknown result kind {name!r} "
                          f"(known: {', '.join(sorted(KINDS))})") from None


def kind_reading(result_type: str) -> ResultKind | None:
    """The kind whose `normalise` reads results of this `type` (a kind's own, or a vocabulary task's)."""
    return next((k for k in _MODULES if result_type in k.READS), None)
