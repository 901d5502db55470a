"""Self-test verdicts: evidence about one candidate in, pass or fail with every reason out.

Pure. The shell (`selftest`) gathers the evidence with real sessions; this module only judges it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from agent.proof.parity import ParityReport, parity_failures
from agent.proof.terms import CPU, LatencyStats, Placement, reason_from_log
from agent.spec.manifest import Manifest


@dataclass(frozen=True)
class Candidate:
    provider: str
    variant: str
    precision: str
    options: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.provider}:{self.variant}"


@dataclass(frozen=True)
class PreprocessCheck:
    """Device preprocessing of each golden raw frame against the bundled tensor."""

    max_abs: float
    worst_sample: int


@dataclass(frozen=True)
class Evidence:
    candidate: Candidate
    error: str | None = None
    effective: tuple[str, ...] = ()
    placement: Placement | None = None
    preprocess: PreprocessCheck | None = None
    parity: ParityReport | None = None
    latency: LatencyStats | None = None
    create_ms: float = 0.0
    ort_log: tuple[str, ...] = ()


@dataclass(frozen=True)
class CandidateResult:
    candidate: Candidate
    passed: bool
    reasons: tuple[str, ...]
    evidence: Evidence | None = None
    status: str = "tested"  # tested | skipped | not_tried

    @property
    def p50(self) -> float:
        lat = self.evidence.latency if self.evidence else None
        return lat.p50_ms if lat else float("inf")

    def to_dict(self) -> dict[str, Any]:
        ev = self.evidence
        out: dict[str, Any] = {
            "provider": self.candidate.provider,
            "variant": self.candidate.variant,
            "precision": self.candidate.precision,
            "options": dict(self.candidate.options),
            "status": self.status,
            "passed": self.passed,
            "reasons": list(self.reasons),
        }
        if ev is not None:
            out.update(
                effective_providers=list(ev.effective),
                placement=ev.placement.to_dict() if ev.placement else None,
                preprocess=asdict(ev.preprocess) if ev.preprocess else None,
                parity=ev.parity.summary() if ev.parity else None,
                latency=asdict(ev.latency) if ev.latency else None,
                create_ms=round(ev.create_ms, 2),
                error=ev.error,
            )
        return out


def judge(ev: Evidence, manifest: Manifest) -> CandidateResult:
    """Every reason this candidate must not serve; passed only when there are none."""
    c = ev.candidate
    st = manifest.selftest
    if ev.error is not None:
        return CandidateResult(c, False, (ev.error,), ev)
    reasons: list[str] = []
    if c.provider not in ev.effective:
        why = reason_from_log(ev.ort_log)
        reasons.append(f"silent fallback: asked for {c.provider}, session runs on {list(ev.effective)}"
                       + (f": {why}" if why else ""))
    if ev.placement is not None and c.provider != CPU and ev.placement.total_nodes:
        frac = ev.placement.fraction(c.provider)
        if frac < st.min_accelerator_fraction:
            on = ev.placement.nodes_by_provider.get(c.provider, 0)
            reasons.append(
                f"placement: {on}/{ev.placement.total_nodes} nodes ({frac:.0%}) on {c.provider}, "
                f"under the minimum {st.min_accelerator_fraction:.0%}"
            )
    if ev.preprocess is not None and ev.preprocess.max_abs > st.preprocess_max_abs:
        reasons.append(
            f"parity max_abs = {ev.preprocess.max_abs:.3g} over threshold {st.preprocess_max_abs:g} "
            f"on sample {ev.preprocess.worst_sample} at stage preprocessing"
        )
    if ev.parity is not None:
        reasons += parity_failures(ev.parity, st.parity[c.precision], stage="model")
    budget = st.budget_for(c.provider)
    if ev.latency is not None and budget is not None and ev.latency.p95_ms > budget:
        reasons.append(f"latency p95 = {ev.latency.p95_ms:.2f} ms over budget {budget:g} ms")
    return CandidateResult(c, not reasons, tuple(reasons), ev)
