"""Self-test verdicts: evidence about one candidate in, pass or fail with every reason out.

Pure. The shell (`selftest`) gathers the evidence with real sessions; this module only judges it,
answering two questions separately: reproduction (does it compute what this variant computed where
it was built?) and fidelity (does it still do the source model's job?), then placement and latency.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from agent.proof.agreement import finite_or_none
from agent.proof.parity import Finding, QuestionResult
from agent.proof.terms import CPU, LatencyStats, Placement, reason_from_log
from agent.vocabulary.manifest import Manifest


@dataclass(frozen=True)
class Candidate:
    provider: str
    variant: str
    precision: str
    options: Mapping[str, str] = field(default_factory=dict)
    # the config pins this variant although its build marked it below a fidelity floor: it may serve,
    # loudly, when it reproduces (its fidelity failures become warnings)
    pinned_below_floor: str | None = None

    @property
    def key(self) -> str:
        return f"{self.provider}:{self.variant}"


@dataclass(frozen=True)
class PreprocessCheck:
    """Device preprocessing of each golden raw frame against the bundled tensor."""

    max_abs: float
    worst_sample: int
    # Beyond the exact bound, what the difference is (agent.proof.pre_compare): the worst sample's fraction of
    # values that differ, its worst difference and channel bias in source levels, whether every sample differs
    # only by the image library's rounding, and otherwise the key that most likely explains it.
    differing: float = 0.0
    max_levels: float | None = None
    bias_levels: float | None = None
    rounding: bool = False
    explanation: str = ""


@dataclass(frozen=True)
class LatencyContext:
    """What the machine was doing while the timing ran: 1-minute load average before and after,
    CPU count, the attempt number (0: the first measurement), whether runs were interleaved, the timed
    runs asked for, and why the loop stopped before them (`selection.latency_settled`), if it did."""

    load_before: float
    load_after: float
    cpus: int
    attempt: int = 0
    interleaved: bool = False
    asked_runs: int = 0
    settled: str | None = None


@dataclass(frozen=True)
class Evidence:
    candidate: Candidate
    error: str | None = None
    effective: tuple[str, ...] = ()
    placement: Placement | None = None
    preprocess: PreprocessCheck | None = None
    reproduction: QuestionResult | None = None
    fidelity: QuestionResult | None = None
    latency: LatencyStats | None = None
    latency_context: LatencyContext | None = None
    create_ms: float = 0.0
    ort_log: tuple[str, ...] = ()


@dataclass(frozen=True)
class CandidateResult:
    candidate: Candidate
    passed: bool
    reasons: tuple[str, ...]
    evidence: Evidence | None = None
    status: str = "tested"  # tested | skipped | not_tried
    findings: tuple[Finding, ...] = ()
    warnings: tuple[Finding, ...] = ()
    budget_ms: float | None = None  # the p95 budget it was judged against: in the report for pass and fail alike

    @property
    def p50(self) -> float:
        lat = self.evidence.latency if self.evidence else None
        return lat.p50_ms if lat else float("inf")

    @property
    def failed_only_on_latency(self) -> bool:
        """Reproduced and kept fidelity, placed where asked, but too slow: the one failure a busy
        machine can cause, so the one worth measuring again."""
        return (not self.passed and self.status == "tested" and bool(self.findings)
                and all(f.check == "latency" for f in self.findings))

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
            "findings": [f.to_dict() for f in self.findings],
            "warnings": [f.to_dict() for f in self.warnings],
            "pinned_below_floor": self.candidate.pinned_below_floor,
        }
        if ev is not None:
            out.update(
                effective_providers=list(ev.effective),
                placement=ev.placement.to_dict() if ev.placement else None,
                preprocess=asdict(ev.preprocess) if ev.preprocess else None,
                reproduction=ev.reproduction.to_dict() if ev.reproduction else None,
                fidelity=ev.fidelity.to_dict() if ev.fidelity else None,
                parity=_parity_summary(ev),
                latency=dict(asdict(ev.latency), budget_ms=self.budget_ms) if ev.latency else None,
                latency_context=asdict(ev.latency_context) if ev.latency_context else None,
                create_ms=round(ev.create_ms, 2),
                error=ev.error,
            )
        doc: dict[str, Any] = json_safe(out)
        return doc


def _parity_summary(ev: Evidence) -> dict[str, Any] | None:
    """A flat view for readers of the older report (`parity`): both answers, the fidelity task
    metrics and the cosine (informational). The two questions' own blocks are the source."""
    if ev.reproduction is None and ev.fidelity is None:
        return None
    out: dict[str, Any] = {}
    if ev.reproduction is not None:
        out["reproduction_passed"] = ev.reproduction.passed
        out["reproduction_against"] = ev.reproduction.against
    if ev.fidelity is not None:
        out["fidelity_passed"] = ev.fidelity.passed
        if ev.fidelity.agreement is not None:
            out.update(ev.fidelity.agreement.metrics)
        out["min_cosine"] = ev.fidelity.cosine
    return out


def judge(ev: Evidence, manifest: Manifest) -> CandidateResult:
    """Every reason this candidate must not serve; passed only when there are none."""
    c = ev.candidate
    st = manifest.selftest
    if ev.error is not None:
        f = Finding("error", ev.error, None, None, "session")
        return CandidateResult(c, False, (ev.error,), ev, findings=(f,))
    findings: list[Finding] = []
    warnings: list[Finding] = []
    if c.provider not in ev.effective:
        why = reason_from_log(ev.ort_log)
        findings.append(Finding("fallback", f"silent fallback: asked for {c.provider}, session runs on "
                                f"{list(ev.effective)}" + (f": {why}" if why else ""), None, None, "session"))
    if ev.placement is not None and c.provider != CPU and ev.placement.total_nodes:
        frac = ev.placement.fraction(c.provider)
        if frac < st.min_accelerator_fraction:
            on = ev.placement.nodes_by_provider.get(c.provider, 0)
            findings.append(Finding("placement", f"fraction of nodes on {c.provider}", frac,
                                    st.min_accelerator_fraction, "session", None,
                                    f"{on}/{ev.placement.total_nodes} nodes", "under"))
    pre = ev.preprocess
    if pre is not None and pre.max_abs > st.preprocess_max_abs:
        stage = "pre" if manifest.preprocess.graph else "preprocessing"
        if pre.rounding:
            # the image library's rounding on this device: the model is proven on the bundled tensors, the task
            # (fidelity) on the device's own; said, never hidden
            warnings.append(Finding("preprocessing", "fraction of values that differ from the bundled tensor by "
                                    "rounding", pre.differing, None, stage, pre.worst_sample,
                                    f"at most {pre.max_levels:.2f} source level(s), channel bias {pre.bias_levels:.2f} "
                                    f"level(s), max_abs {pre.max_abs:.4g}: this device's image library rounds "
                                    "differently; fidelity judged on the device's own tensors"))
        else:
            findings.append(Finding("preprocessing", "max_abs of device preprocessing vs bundled tensor",
                                    pre.max_abs, st.preprocess_max_abs, stage, pre.worst_sample, pre.explanation,
                                    "over"))
    if ev.reproduction is not None:
        findings += ev.reproduction.findings
    if ev.fidelity is not None:
        if c.pinned_below_floor:
            warnings += [_as_warning(f, c) for f in ev.fidelity.findings if f.check == "fidelity"]
            findings += [f for f in ev.fidelity.findings if f.check != "fidelity"]
        else:
            findings += ev.fidelity.findings
    if c.pinned_below_floor:
        warnings.append(Finding("fidelity", f"variant {c.variant} is pinned by the config although its build "
                                f"marked it below a fidelity floor: {c.pinned_below_floor}", None, None, "build"))
    budget = st.budget_for(c.provider)
    if ev.latency is not None and budget is not None and ev.latency.p95_ms > budget:
        ctx = ev.latency_context
        findings.append(Finding("latency", "p95 ms", ev.latency.p95_ms, budget, "latency", None,
                                f"p50 {ev.latency.p50_ms:.2f} ms" + (
                                    f", load average {ctx.load_before:.2f} before and {ctx.load_after:.2f} after, "
                                    f"{ctx.cpus} CPUs" if ctx else ""), "over"))
    reasons = tuple(_reason_text(f) for f in findings)
    return CandidateResult(c, not findings, reasons, ev, findings=tuple(findings), warnings=tuple(warnings),
                           budget_ms=budget)


def _as_warning(f: Finding, c: Candidate) -> Finding:
    return Finding(f.check, f.metric, f.value, f.bound, f.stage, f.sample,
                   (f.detail + "; " if f.detail else "") + "pinned by the config: served anyway", f.comparison)


def _reason_text(f: Finding) -> str:
    if f.check in ("error", "fallback"):
        return f.metric
    if f.check == "latency":
        # kept in the old form too: "latency p95 = X ms over budget Y ms" is what people grep for
        return f"latency p95 = {f.value:.2f} ms over budget {f.bound:g} ms at stage latency ({f.detail})"
    return f.text()


def json_safe(obj: Any) -> Any:
    """The same structure with every NaN/Infinity replaced by None: strict JSON parsers refuse them,
    and a non-finite figure is always also named in a finding."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", None) == 0:
        return json_safe(obj.item())
    return obj


__all__ = ["Candidate", "CandidateResult", "Evidence", "LatencyContext", "PreprocessCheck", "judge", "json_safe",
           "finite_or_none"]
