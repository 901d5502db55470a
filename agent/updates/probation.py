"""Probation: a pure judge over the frames a new bundle really served after the switch.

The controller's tick watches (the shell, `ProbationWatch`); this module decides, from counts and
latencies only. No results is a failure, not a pass: a bundle that refuses every frame (a frame-format
mismatch) served nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from agent.quantiles import percentile


@dataclass(frozen=True)
class ProbationEvidence:
    """What the new engine did on probation."""

    seconds: float
    frames: int            # frames handed to the new engine's preprocessing
    results: int           # results published from the new engine
    refused: int           # frames its preprocessing refused
    inference_errors: int
    non_finite: int        # inferences with NaN/inf outputs
    inference_p95_ms: float | None
    budget_ms: float | None  # the bundle's latency budget for the provider; None: no budget
    post_refused: int = 0  # results its post stage refused (a post graph's outputs its result kind refuses)
    # the update's own proof served it degraded (selection.when_too_slow: degraded): the same policy here, so a
    # device too slow for the budget takes an update that is no worse instead of refusing the slowness it accepted
    when_too_slow: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProbationVerdict:
    passed: bool
    reasons: tuple[str, ...]
    evidence: ProbationEvidence

    @property
    def summary(self) -> str:
        e = self.evidence
        if not self.passed:
            return "probation: " + "; ".join(self.reasons)
        p95 = "-" if e.inference_p95_ms is None else f"{e.inference_p95_ms:.2f} ms"
        return f"{e.results} results from {e.frames} frames, inference p95 {p95}, no errors" + (
            f" (DEGRADED: over budget {e.budget_ms:g} ms, served under selection.when_too_slow: degraded)"
            if over_budget(e) else "")

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": list(self.reasons), "evidence": self.evidence.to_dict()}


def probation_over(seconds: float, results: int, errors: int, stopping: bool, limit_s: float,
                   limit_results: int) -> bool:
    """Whether a probation has seen enough: its time or its results, a first error, or a shutdown."""
    return seconds >= limit_s or results >= limit_results or errors > 0 or stopping


def p95(samples: Sequence[float]) -> float | None:
    return percentile(samples, 95) if len(samples) else None


def judge_probation(e: ProbationEvidence) -> ProbationVerdict:
    """Every rule that fails is a reason; passed only when none does."""
    reasons = []
    if e.results == 0:
        why = (f"all {e.frames} frames refused by its preprocessing (frame-format mismatch)"
               if e.frames and e.refused == e.frames else f"{e.frames} frames in, none served")
        reasons.append(f"zero results in {e.seconds:.1f} s: {why}")
    elif e.refused:
        reasons.append(f"{e.refused} of {e.frames} frames refused by its preprocessing (frame-format mismatch)")
    if e.inference_errors:
        reasons.append(f"{e.inference_errors} inference errors")
    if e.non_finite:
        reasons.append(f"{e.non_finite} inferences with non-finite outputs")
    if e.post_refused:
        reasons.append(f"{e.post_refused} results refused by its post stage (postprocess.graph)")
    if over_budget(e) and e.when_too_slow != "degraded":
        reasons.append(f"inference p95 = {e.inference_p95_ms:.2f} ms over budget {e.budget_ms:g} ms")
    return ProbationVerdict(not reasons, tuple(reasons), e)


def over_budget(e: ProbationEvidence) -> bool:
    return e.budget_ms is not None and e.inference_p95_ms is not None and (
        not math.isfinite(e.inference_p95_ms) or e.inference_p95_ms > e.budget_ms)
