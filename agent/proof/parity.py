"""The two questions' measurements: reproduction (allclose against a variant's own recorded outputs)
and fidelity (task metrics against the source model's references).

Pure. No metric here passes a candidate on cosine: tensors are judged with allclose-style bounds whose
atol scales with each output's (or each channel's) range, and tasks with their own agreement
(margin-aware top-1 with a Wilson interval, matched detections, mask IoU, per-channel SNR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from agent.vocabulary.manifest import PostprocessSpec
from agent.proof.agreement import (  # noqa: F401 (the task metrics, imported from here by callers)
    DEFAULT_DECISION_AGREEMENT,
    SNR_CAP_DB,
    WILSON_Z,
    TaskAgreement,
    _batched_axis,
    _channel_view,
    agreement_score,
    channel_axis,
    channel_snr,
    classification_agreement,
    decision_task_agreement,
    detection_agreement,
    finite_or_none,
    mask_iou,
    match_detections,
    segmentation_agreement,
    task_agreement,
    wilson_interval,
)
from agent.proof.terms import CPU

Outputs = Mapping[str, np.ndarray]
Check = Literal["reproduction", "fidelity", "output", "preprocessing", "latency", "placement", "fallback", "error"]


@dataclass(frozen=True)
class Finding:
    """One reason a candidate must not serve (or, with `warning`, a loud note): metric, value, bound,
    sample and stage, so the reader never has to guess which number broke which rule."""

    check: Check
    metric: str
    value: float | None
    bound: float | None
    stage: str = "model"
    sample: int | None = None
    detail: str = ""
    comparison: Literal["over", "under", ""] = ""

    def text(self) -> str:
        head = f"{self.check}: {self.metric}"
        if self.value is not None:
            head += f" = {_fmt(self.value)}"
        if self.bound is not None and self.comparison:
            head += f" {self.comparison} bound {_fmt(self.bound)}"
        if self.sample is not None:
            head += f" on sample {self.sample}"
        head += f" at stage {self.stage}"
        return head + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "metric": self.metric, "value": finite_or_none(self.value),
                "bound": finite_or_none(self.bound), "sample": self.sample, "stage": self.stage,
                "detail": self.detail, "text": self.text()}


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


# ---------------------------------------------------------------- bounds and floors

ProviderClass = Literal["cpu", "gpu", "openvino"]


@dataclass(frozen=True)
class ReproductionBounds:
    """|got - recorded| <= atol + rtol*|recorded| element-wise, atol = max(atol_range * range, atol_min)
    where range is max - min of the recorded output (per channel for `raw` with a channel axis).
    `min_agreement` bounds the decoded results' agreement (top-1, min(recall, precision), mask IoU)."""

    atol_range: float
    rtol: float
    atol_min: float
    min_agreement: float


# Where kernels legitimately differ (GPU TF32/FP16, OpenVINO precision hints, INT8 kernels on another
# CPU), bounds are looser; FP32 on CPU is tight. Overridable per precision in `selftest.reproduction`.
DEFAULT_REPRODUCTION: dict[tuple[str, ProviderClass], ReproductionBounds] = {
    ("fp32", "cpu"): ReproductionBounds(atol_range=1e-4, rtol=1e-3, atol_min=1e-6, min_agreement=0.99),
    ("fp32", "gpu"): ReproductionBounds(atol_range=1e-2, rtol=1e-2, atol_min=1e-5, min_agreement=0.95),
    ("fp32", "openvino"): ReproductionBounds(atol_range=2e-2, rtol=2e-2, atol_min=1e-5, min_agreement=0.95),
    ("fp16", "cpu"): ReproductionBounds(atol_range=2e-2, rtol=2e-2, atol_min=1e-4, min_agreement=0.95),
    ("fp16", "gpu"): ReproductionBounds(atol_range=2e-2, rtol=2e-2, atol_min=1e-4, min_agreement=0.95),
    ("fp16", "openvino"): ReproductionBounds(atol_range=3e-2, rtol=3e-2, atol_min=1e-4, min_agreement=0.95),
    ("int8", "cpu"): ReproductionBounds(atol_range=3e-2, rtol=3e-2, atol_min=1e-4, min_agreement=0.95),
    ("int8", "gpu"): ReproductionBounds(atol_range=6e-2, rtol=6e-2, atol_min=1e-4, min_agreement=0.9),
    ("int8", "openvino"): ReproductionBounds(atol_range=6e-2, rtol=6e-2, atol_min=1e-4, min_agreement=0.9),
}


def provider_class(provider: str) -> ProviderClass:
    if provider == CPU:
        return "cpu"
    if provider == "OpenVINOExecutionProvider":
        return "openvino"
    return "gpu"  # CUDA, TensorRT, DirectML, ROCm, ...: reduced-precision math is their default


def reproduction_bounds(precision: str, provider: str,
                        overrides: Mapping[str, Mapping[str, float]] | None = None) -> ReproductionBounds:
    """Code default for (precision, provider class), then `selftest.reproduction.<precision>` and
    `selftest.reproduction.<precision>@<cpu|gpu|openvino>` from the manifest, most specific last."""
    cls = provider_class(provider)
    b = DEFAULT_REPRODUCTION.get((precision, cls), DEFAULT_REPRODUCTION[("int8", cls)])
    values = {"atol_range": b.atol_range, "rtol": b.rtol, "atol_min": b.atol_min, "min_agreement": b.min_agreement}
    for key in (precision, f"{precision}@{cls}"):
        values.update((overrides or {}).get(key, {}))
    return ReproductionBounds(**values)


@dataclass(frozen=True)
class FidelityFloors:
    """Task floors against the source model's references. Set by the bundle's author
    (`selftest.fidelity`) or the per-task defaults; never lowered to what a build measured."""

    min_top1_agreement: float | None = None
    min_recall: float | None = None
    min_precision: float | None = None
    min_mask_iou: float | None = None
    min_channel_snr_db: float | None = None
    min_decision_agreement: float | None = None  # raw with a decision (None: DEFAULT_DECISION_AGREEMENT)
    # classification: a flip where the reference's own top-1/top-2 probability margin is under this is
    # not counted (the source model itself could not tell the classes apart)
    negligible_margin: float = 0.02


DEFAULT_FIDELITY: dict[str, FidelityFloors] = {
    "classification": FidelityFloors(min_top1_agreement=0.98),
    "detection": FidelityFloors(min_recall=0.9, min_precision=0.9),
    "segmentation": FidelityFloors(min_mask_iou=0.9),
    "raw": FidelityFloors(min_channel_snr_db=15.0),
}


def fidelity_floors(task: str, authored: Mapping[str, float] | None = None) -> FidelityFloors:
    base = DEFAULT_FIDELITY.get(task, DEFAULT_FIDELITY["raw"])
    values = {k: getattr(base, k) for k in FidelityFloors.__dataclass_fields__}
    # the result kinds' own floors (score_tolerance, match_iou, ...) are theirs (agent.proof.stage_proof.kind_floors)
    values.update({k: v for k, v in (authored or {}).items() if k in FidelityFloors.__dataclass_fields__})
    return FidelityFloors(**values)


# ---------------------------------------------------------------- tensor checks

def output_problems(got: Sequence[Outputs], ref: Sequence[Outputs], stage: str = "model") -> list[Finding]:
    """Missing outputs, shape changes and non-finite values, each named as such (never as a distance)."""
    out: list[Finding] = []
    for i, (g, r) in enumerate(zip(got, ref)):
        for name, b in r.items():
            if name not in g:
                out.append(Finding("output", f"missing output {name}", None, None, stage, i))
                continue
            a = np.asarray(g[name])
            if a.shape != np.asarray(b).shape:
                out.append(Finding("output", f"shape change of output {name}", None, None, stage, i,
                                   f"got {list(a.shape)}, expected {list(np.asarray(b).shape)}"))
                continue
            if a.dtype.kind == "f":
                nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
                if nan or inf:
                    out.append(Finding("output", f"non-finite output {name}", float(nan + inf), 0.0, stage, i,
                                       f"{nan} NaN, {inf} Inf of {a.size} values", "over"))
    return out


# A raw detection head mixes quantities of very different range in one tensor: box coordinates
# (0..640) beside class scores (0..1). One range for the whole tensor let the box channels set the
# tolerance (9.55 on a YOLO head), leaving the scores unchecked. Each group below gets its own range.
# (axis in batched numbering, ((first channel, end) ...)); end None: to the last channel.
DETECTION_GROUPS: dict[str, tuple[int, tuple[tuple[int, int | None], ...]]] = {
    "yolov8": (1, ((0, 4), (4, None))),             # [B, 4+C, N]: boxes, class scores
    "yolov5": (-1, ((0, 4), (4, 5), (5, None))),    # [B, N, 5+C]: boxes, objectness, class scores
    "end2end": (-1, ((0, 4), (4, 5), (5, 6))),      # [B, N, 6]: boxes, score, class
}


def channel_groups(spec: PostprocessSpec) -> tuple[int, tuple[tuple[int, int | None], ...]] | None:
    """Groups of channels judged each against its own range (single-tensor detection layouts)."""
    return DETECTION_GROUPS.get(spec.layout) if spec.type == "detection" else None


def _split_groups(name: str, a: np.ndarray, r: np.ndarray,
                  groups: tuple[int, tuple[tuple[int, int | None], ...]] | None
                  ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(label, got, recorded) per channel group of one stacked output; the whole output without groups."""
    if groups is None:
        return [(name, a, r)]
    axis = _batched_axis(groups[0], a.ndim)
    if axis is None or not 1 <= axis < a.ndim:
        return [(name, a, r)]
    n = a.shape[axis]
    out = []
    for lo, hi in groups[1]:
        end = n if hi is None else min(hi, n)
        if lo < end:
            idx = np.arange(lo, end)
            out.append((f"{name} channels {lo}:{end}", np.take(a, idx, axis=axis), np.take(r, idx, axis=axis)))
    return out or [(name, a, r)]


@dataclass(frozen=True)
class ToleranceResult:
    """The worst element against its allclose bound, over all samples and outputs."""

    passed: bool
    output: str | None = None
    sample: int | None = None
    channel: int | None = None
    abs_diff: float = 0.0
    bound: float = 0.0
    violations: int = 0
    elements: int = 0
    atol_by_output: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "output": self.output, "sample": self.sample, "channel": self.channel,
                "abs_diff": finite_or_none(self.abs_diff), "bound": finite_or_none(self.bound),
                "violations": self.violations, "elements": self.elements,
                "atol_by_output": {k: finite_or_none(v) for k, v in self.atol_by_output.items()}}


def allclose_check(got: Sequence[Outputs], recorded: Sequence[Outputs], b: ReproductionBounds,
                   axis: int | None = None,
                   groups: tuple[int, tuple[tuple[int, int | None], ...]] | None = None) -> ToleranceResult:
    """allclose with atol scaled to each output's range (per channel along `axis`, or per channel
    group of a detection head), never a bare relative error: a map whose recorded max is 1e-7 is
    judged against atol_min, not divided by 1e-7."""
    worst: tuple[float, str, int, int, float, float] | None = None  # (excess, output, sample, channel, diff, bound)
    violations = elements = 0
    atols: dict[str, float] = {}
    names = list(recorded[0]) if recorded else []
    for name in names:
        try:
            got_n = [np.asarray(g[name], dtype=np.float64) for g in got]
            rec_n = [np.asarray(x[name], dtype=np.float64) for x in recorded]
        except KeyError:
            continue  # named by output_problems
        if len(got_n) != len(rec_n) or not rec_n:
            continue
        if len({x.shape for x in got_n + rec_n}) == 1:
            pieces = [(0, np.stack(got_n), np.stack(rec_n))]
        else:  # a shape that follows the frame's size (a dynamic-size model): bounded sample by sample
            pieces = [(i, a[None], r[None]) for i, (a, r) in enumerate(zip(got_n, rec_n))]
        for first, a, r in pieces:
            if a.shape != r.shape:
                continue  # named by output_problems
            worst, violations, elements = _allclose_piece(name, first, a, r, b, axis, groups, atols, worst,
                                                          violations, elements)
    if worst is None:
        return ToleranceResult(True, atol_by_output=atols)
    return ToleranceResult(violations == 0, worst[1], worst[2], worst[3] if axis is not None else None,
                           worst[4], worst[5], violations, elements, atols)


def _allclose_piece(name: str, first: int, a: np.ndarray, r: np.ndarray, b: ReproductionBounds, axis: int | None,
                    groups: tuple[int, tuple[tuple[int, int | None], ...]] | None, atols: dict[str, float],
                    worst: tuple[float, str, int, int, float, float] | None, violations: int, elements: int,
                    ) -> tuple[tuple[float, str, int, int, float, float] | None, int, int]:
    """One stacked output (samples `first`.. of it) against its recorded values: allclose_check's body."""
    for label, ga, gr in _split_groups(name, a, r, groups):
        ca, cr = _channel_view(ga, axis), _channel_view(gr, axis)
        if cr.size == 0:
            continue
        span = cr.max(axis=1) - cr.min(axis=1)
        atol = np.maximum(b.atol_range * span, b.atol_min)[:, None]
        atols[label] = float(atol.min())
        bound = atol + b.rtol * np.abs(cr)
        diff = np.abs(ca - cr)
        diff = np.where(np.isfinite(diff), diff, np.inf)
        bad = diff > bound
        violations += int(bad.sum())
        elements += int(diff.size)
        excess = diff - bound
        k = int(np.argmax(excess))
        if worst is None or excess.flat[k] > worst[0]:
            ch, pos = divmod(k, ca.shape[1])
            # position inside the channel-major view back to the sample index
            per_sample = ca.shape[1] // ga.shape[0]
            worst = (float(excess.flat[k]), label, first + pos // max(per_sample, 1), ch,
                     float(diff.flat[k]), float(bound.flat[k]))
    return worst, violations, elements


def cosine(got: Sequence[Outputs], ref: Sequence[Outputs]) -> float | None:
    """Worst per-sample cosine: reported for the reader, never a pass on its own."""
    worst: float | None = None
    for g, r in zip(got, ref):
        try:
            a = np.concatenate([np.asarray(g[k], dtype=np.float64).ravel() for k in r])
            b = np.concatenate([np.asarray(r[k], dtype=np.float64).ravel() for k in r])
        except (KeyError, ValueError):
            return None
        if a.shape != b.shape or not np.all(np.isfinite(a)):
            return None
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        c = float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        worst = c if worst is None else min(worst, c)
    return worst


@dataclass(frozen=True)
class QuestionResult:
    """One question's answer for one candidate: what it was compared against, the figures, and the
    findings (empty when it holds)."""

    question: Literal["reproduction", "fidelity"]
    against: str  # "variant" (its own recorded outputs) | "source" (the source model's references)
    findings: tuple[Finding, ...]
    agreement: TaskAgreement | None = None
    tolerance: ToleranceResult | None = None
    cosine: float | None = None
    bounds: Mapping[str, float] = field(default_factory=dict)
    warnings: tuple[Finding, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "against": self.against,
                "metrics": self.agreement.to_dict()["metrics"] if self.agreement else {},
                "worst_sample": self.agreement.worst_sample if self.agreement else None,
                "detail": self.agreement.detail if self.agreement else "",
                "tolerance": self.tolerance.to_dict() if self.tolerance else None,
                "cosine": finite_or_none(self.cosine),
                "bounds": {k: finite_or_none(v) for k, v in self.bounds.items()},
                "findings": [f.to_dict() for f in self.findings],
                "warnings": [f.to_dict() for f in self.warnings]}


def judge_reproduction(spec: PostprocessSpec, got: Sequence[Outputs], recorded: Sequence[Outputs],
                       b: ReproductionBounds, against: str = "variant", stage: str = "model",
                       tensor_bound: bool = True) -> QuestionResult:
    """Tensors within allclose bounds of the recorded outputs, and decoded results in agreement.
    `tensor_bound=False` (a reduced-precision variant whose own outputs were never recorded, judged
    against the source) keeps only the decoded agreement."""
    findings = output_problems(got, recorded, stage)
    tol = allclose_check(got, recorded, b, channel_axis(spec), channel_groups(spec)) if tensor_bound else None
    if tol is not None and not tol.passed and tol.violations:
        where = f"output {tol.output}" + (f" channel {tol.channel}" if tol.channel is not None else "")
        findings.append(Finding("reproduction", "max |a-b| beyond atol + rtol*|b|", tol.abs_diff, tol.bound, stage,
                                tol.sample, f"{where}; {tol.violations}/{tol.elements} elements out of bound; "
                                f"atol {b.atol_range:g}*range (min {b.atol_min:g}), rtol {b.rtol:g}", "over"))
    agreement = None
    if not any(f.check == "output" for f in findings):
        agreement = task_agreement(spec, got, recorded)
        score = agreement_score(agreement)
        if score < b.min_agreement:
            findings.append(Finding("reproduction", f"decoded {_score_name(agreement)}", score, b.min_agreement,
                                    stage, agreement.worst_sample, agreement.detail, "under"))
    bounds = {"atol_range": b.atol_range, "rtol": b.rtol, "atol_min": b.atol_min, "min_agreement": b.min_agreement}
    return QuestionResult("reproduction", against, tuple(findings), agreement, tol, cosine(got, recorded), bounds)


def _score_name(a: TaskAgreement) -> str:
    return {"classification": "top-1 agreement (Wilson upper)", "detection": "min(recall, precision)",
            "segmentation": "mask IoU"}.get(a.task, "agreement")


def judge_fidelity(spec: PostprocessSpec, got: Sequence[Outputs], references: Sequence[Outputs],
                   floors: FidelityFloors, stage: str = "model") -> QuestionResult:
    """Task metrics against the source model's references, each checked against its floor."""
    findings = output_problems(got, references, stage)
    agreement = None
    if not any(f.check == "output" for f in findings):
        agreement = task_agreement(spec, got, references, floors.negligible_margin)
        m = agreement.metrics
        checks: list[tuple[str, float, float | None]] = []
        if agreement.task == "classification":
            # refuse only when even the interval's upper end is under the floor: 1 flip in 32 is no cliff
            checks.append(("top-1 agreement", m["top1_agreement"], floors.min_top1_agreement))
            if floors.min_top1_agreement is not None and m["top1_wilson_high"] >= floors.min_top1_agreement:
                checks.pop()
        elif agreement.task == "detection":
            checks += [("recall", m["recall"], floors.min_recall), ("precision", m["precision"], floors.min_precision)]
        elif agreement.task == "segmentation":
            checks.append(("mask IoU", m["mask_iou"], floors.min_mask_iou))
        elif "decision_agreement" in m:
            floor = floors.min_decision_agreement
            checks.append(("decision agreement", m["decision_agreement"],
                           DEFAULT_DECISION_AGREEMENT if floor is None else floor))
        else:
            checks.append(("worst channel SNR dB", m["min_channel_snr_db"], floors.min_channel_snr_db))
        for metric, value, floor in checks:
            if floor is not None and value < floor:
                findings.append(Finding("fidelity", metric, value, floor, stage, agreement.worst_sample,
                                        agreement.detail, "under"))
    bounds = {k: v for k, v in floors.__dict__.items() if v is not None}
    return QuestionResult("fidelity", "source", tuple(findings), agreement, None, cosine(got, references), bounds)
