"""Parity between a candidate's outputs and the golden reference: tensor distance and task agreement.

Pure. Cosine alone is not enough (a detector can keep cosine 0.998 and lose most of its boxes), so
each task adds its own agreement: top-1/top-k for classification, matched recall/precision for detection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from agent.spec.decoders import class_scores, decode_detections, iou
from agent.spec.manifest import ParityThresholds, PostprocessSpec

Outputs = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class SampleDistance:
    sample: int
    max_abs: float
    max_rel: float
    cosine: float


@dataclass(frozen=True)
class ParityReport:
    samples: tuple[SampleDistance, ...]
    agreement: Mapping[str, float] = field(default_factory=dict)

    @property
    def worst_max_abs(self) -> SampleDistance:
        return max(self.samples, key=lambda s: s.max_abs)

    @property
    def worst_max_rel(self) -> SampleDistance:
        return max(self.samples, key=lambda s: s.max_rel)

    @property
    def worst_cosine(self) -> SampleDistance:
        return min(self.samples, key=lambda s: s.cosine)

    def summary(self) -> dict[str, float]:
        out = {
            "max_abs": self.worst_max_abs.max_abs,
            "max_rel": self.worst_max_rel.max_rel,
            "min_cosine": self.worst_cosine.cosine,
        }
        out.update(self.agreement)
        return out


def tensor_distance(sample: int, got: Outputs, ref: Outputs) -> SampleDistance:
    """Distances over all outputs of one sample, concatenated."""
    a = np.concatenate([np.asarray(got[k], dtype=np.float64).ravel() for k in ref])
    b = np.concatenate([np.asarray(ref[k], dtype=np.float64).ravel() for k in ref])
    if a.shape != b.shape:
        return SampleDistance(sample, float("inf"), float("inf"), -1.0)
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(b).max()) if b.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cosine = float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    if not np.all(np.isfinite(a)):
        return SampleDistance(sample, float("inf"), float("inf"), -1.0)
    return SampleDistance(sample, max_abs, max_rel, cosine)


def classification_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> dict[str, float]:
    top1 = topk = 0
    for g, r in zip(got, ref):
        gs, rs = class_scores(spec, g), class_scores(spec, r)
        r1 = int(np.argmax(rs))
        top1 += int(np.argmax(gs)) == r1
        topk += r1 in np.argsort(-gs, kind="stable")[: spec.top_k]
    n = max(len(ref), 1)
    return {"top1_agreement": top1 / n, "topk_agreement": topk / n}


def detection_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs], min_iou: float = 0.5) -> dict[str, float]:
    """Detections matched greedily to the reference: same class and IoU >= min_iou."""
    matched = n_ref = n_got = 0
    for g, r in zip(got, ref):
        dg, dr = decode_detections(spec, g), decode_detections(spec, r)
        n_ref += len(dr)
        n_got += len(dg)
        used: set[int] = set()
        for d in dr:
            best, best_iou = -1, min_iou
            for j, c in enumerate(dg):
                if j in used or c.class_id != d.class_id:
                    continue
                o = float(iou(np.asarray([d.box]), np.asarray([c.box]))[0, 0])
                if o >= best_iou:
                    best, best_iou = j, o
            if best >= 0:
                used.add(best)
                matched += 1
    recall = matched / n_ref if n_ref else 1.0
    precision = matched / n_got if n_got else (1.0 if n_ref == 0 else 0.0)
    return {"recall": recall, "precision": precision, "reference_detections": float(n_ref)}


def compare(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> ParityReport:
    distances = tuple(tensor_distance(i, g, r) for i, (g, r) in enumerate(zip(got, ref)))
    if spec.type == "classification":
        agreement = classification_agreement(spec, got, ref)
    elif spec.type == "detection":
        agreement = detection_agreement(spec, got, ref)
    else:
        agreement = {}
    return ParityReport(distances, agreement)


def parity_failures(report: ParityReport, t: ParityThresholds, stage: str = "model") -> list[str]:
    """Every threshold the report breaks, as sentences naming metric, value, threshold and sample."""
    out: list[str] = []
    if t.max_abs is not None and report.worst_max_abs.max_abs > t.max_abs:
        w = report.worst_max_abs
        out.append(f"parity max_abs = {w.max_abs:.3g} over threshold {t.max_abs:g} on sample {w.sample} at stage {stage}")
    if t.max_rel is not None and report.worst_max_rel.max_rel > t.max_rel:
        w = report.worst_max_rel
        out.append(f"parity max_rel = {w.max_rel:.3g} over threshold {t.max_rel:g} on sample {w.sample} at stage {stage}")
    if t.min_cosine is not None and report.worst_cosine.cosine < t.min_cosine:
        w = report.worst_cosine
        out.append(f"parity cosine = {w.cosine:.6f} under threshold {t.min_cosine:g} on sample {w.sample} at stage {stage}")
    checks = (
        ("top1_agreement", t.min_top1_agreement),
        ("topk_agreement", t.min_topk_agreement),
        ("recall", t.min_recall),
        ("precision", t.min_precision),
    )
    for key, bound in checks:
        if bound is not None and key in report.agreement and report.agreement[key] < bound:
            out.append(f"parity {key} = {report.agreement[key]:.4f} under threshold {bound:g} at stage {stage}")
    return out
