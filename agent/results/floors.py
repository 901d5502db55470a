"""A result kind's floors and the findings that break them: the bundle's `selftest.fidelity` over the
kind's defaults (never a measured figure), and Finding builders that name metric, value, bound and sample.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, TypeVar

from agent.errors import BundleError
from agent.proof.parity import Finding

Figures = dict[str, Any]


def merge_floors(kind: str, defaults: Mapping[str, float], authored: Mapping[str, Any] | None) -> dict[str, float]:
    """The kind's defaults, overridden by the bundle's floors; an unknown key or a non-number is an error
    (a floor the author wrote and nothing reads would be a gate that cannot fail)."""
    out = dict(defaults)
    for key, value in (authored or {}).items():
        if key not in defaults:
            raise BundleError(f"key selftest.fidelity.{key}: not a floor of result kind {kind} "
                              f"(its floors: {', '.join(sorted(defaults))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise BundleError(f"key selftest.fidelity.{key}: a number wanted, found {value!r}")
        out[key] = float(value)
    return out


def json_figures(figures: Figures) -> Figures:
    """Figures a report can carry as strict JSON: a non-finite number becomes None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}


def under(metric: str, value: float, floor: float, stage: str, sample: int | None, detail: str = "") -> Finding:
    return Finding("fidelity", metric, float(value), float(floor), stage, sample, detail, "under")


def over(metric: str, value: float, bound: float, stage: str, sample: int | None, detail: str = "") -> Finding:
    return Finding("fidelity", metric, float(value), float(bound), stage, sample, detail, "over")


def count_mismatch(kind: str, served: Sequence[object], answers: Sequence[Mapping[str, Any]], stage: str,
                   normalise: Callable[[Mapping[str, Any]], object] | None = None) -> Finding | None:
    """Served results and answers must pair up one per sample. With `normalise`, every package answer is read
    first, whatever the counts: a malformed answer is the caller's error, named, never a quiet mismatch."""
    for i, a in enumerate(answers):
        if normalise is None:
            break
        try:
            normalise(a)
        except BundleError as exc:
            raise BundleError(f"package answer for sample {i}: {exc}") from exc
    if len(served) == len(answers):
        return None
    return Finding("fidelity", f"{kind} results paired with package answers", float(len(served)),
                   float(len(answers)), stage, None,
                   f"{len(served)} served results for {len(answers)} package answers: one per sample wanted")


def sample_list(samples: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in samples[:limit])
    return shown + (f" and {len(samples) - limit} more" if len(samples) > limit else "")


V = TypeVar("V")


def read_pairs(kind: str, normalise: Callable[[Mapping[str, Any]], V], served: Sequence[Mapping[str, Any]],
               answers: Sequence[Mapping[str, Any]], stage: str) -> tuple[list[tuple[int, V, V]], list[Finding]]:
    """(sample, served value, package value) per sample. A served result the kind cannot read is a finding on
    its sample (the bundle served something else), never a crash; a package answer it cannot read is an error
    naming the sample (answers are checked when read, so this is a caller's mistake)."""
    pairs: list[tuple[int, V, V]] = []
    unreadable: list[Finding] = []
    for i, (s, a) in enumerate(zip(served, answers)):
        try:
            want = normalise(a)
        except BundleError as exc:
            raise BundleError(f"package answer for sample {i}: {exc}") from exc
        try:
            got = normalise(s)
        except BundleError as exc:
            unreadable.append(Finding("fidelity", f"served result readable as {kind}", None, None, stage, i, str(exc)))
            continue
        pairs.append((i, got, want))
    return pairs, unreadable
