"""Task agreement between two sets of outputs, by task: margin-aware top-1 with a Wilson interval
(classification), matched detections (detection), mask IoU (segmentation), per-channel SNR (raw), decisions
(a threshold or an argmax). Pure; `parity` judges fidelity and decoded reproduction with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from agent.vocabulary.decoders import class_scores, decode_detections, iou
from agent.vocabulary.manifest import PostprocessSpec

Outputs = Mapping[str, np.ndarray]
WILSON_Z = 1.96
SNR_CAP_DB = 120.0  # identical tensors: a finite figure that JSON can carry


def finite_or_none(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(float(v)) else float(v)


def _channel_view(x: np.ndarray, axis: int | None) -> np.ndarray:
    """(channels, values) of one stacked output [S, ...]: channels along `axis` (in the batched
    tensor's numbering, so axis 1 is the first axis after the batch), or one channel for all."""
    axis = _batched_axis(axis, x.ndim)
    if axis is None or x.ndim < 2 or not (1 <= axis < x.ndim):
        return x.reshape(1, -1)
    return np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def _batched_axis(axis: int | None, ndim: int) -> int | None:
    """A declared axis in the stacked tensor's numbering; negative counts from the end (-1: channels last)."""
    return axis + ndim if axis is not None and axis < 0 else axis


def channel_axis(spec: PostprocessSpec) -> int | None:
    """The declared channel axis of raw outputs (batched numbering; 1 unless the bundle says otherwise)."""
    if spec.type == "graph":  # a post-graph bundle's model outputs: the axis it declares, else one range each
        return getattr(spec, "stage_channel_axis", None)
    return getattr(spec, "channel_axis", 1) if spec.type == "raw" else None


def wilson_interval(successes: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class TaskAgreement:
    """A task's agreement between two sets of outputs. `metrics` are the figures; `worst_sample` names
    the sample that hurt most; `score` is the one number a bound is checked against."""

    task: str
    metrics: Mapping[str, float]
    worst_sample: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "metrics": {k: finite_or_none(v) for k, v in self.metrics.items()},
                "worst_sample": self.worst_sample, "detail": self.detail}


def classification_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs],
                             negligible_margin: float = 0.02) -> TaskAgreement:
    flips = counted = ignored = 0
    first_flip: int | None = None
    for i, (g, r) in enumerate(zip(got, ref)):
        gs, rs = class_scores(spec, g), class_scores(spec, r)
        order = np.argsort(-rs, kind="stable")
        margin = float(rs[order[0]] - rs[order[1]]) if rs.size > 1 else float("inf")
        if not np.all(np.isfinite(gs)):
            flips, counted = flips + 1, counted + 1
            first_flip = i if first_flip is None else first_flip
            continue
        pick = int(np.argmax(gs))
        # Only a swap of the reference's own top-1 and top-2 is ignored when their margin is negligible:
        # any other pick is a wrong answer, however close the reference's top-2 was (and after a second
        # softmax over probabilities every margin is negligible).
        if margin < negligible_margin and pick == int(order[1]):
            ignored += 1
            continue
        counted += 1
        if pick != int(order[0]):
            flips += 1
            first_flip = i if first_flip is None else first_flip
    agree = (counted - flips) / counted if counted else 1.0
    lo, hi = wilson_interval(counted - flips, counted)
    return TaskAgreement("classification", {
        "top1_agreement": agree, "top1_flips": float(flips), "top1_counted": float(counted),
        "top1_ignored_negligible_margin": float(ignored), "top1_wilson_low": lo, "top1_wilson_high": hi,
    }, first_flip, f"{flips}/{counted} flips, {ignored} ignored (reference margin < {negligible_margin:g})")


def match_detections(dg: Sequence[Any], dr: Sequence[Any], min_iou: float = 0.5) -> int:
    """Reference detections matched greedily (by reference score) to distinct same-class detections."""
    matched, used = 0, set()
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
    return matched


def detection_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs],
                        min_iou: float = 0.5) -> TaskAgreement:
    matched = n_ref = n_got = 0
    worst, worst_score = None, 2.0
    for i, (g, r) in enumerate(zip(got, ref)):
        dg, dr = decode_detections(spec, g), decode_detections(spec, r)
        m = match_detections(dg, dr, min_iou)
        matched, n_ref, n_got = matched + m, n_ref + len(dr), n_got + len(dg)
        score = min(m / len(dr) if dr else 1.0, m / len(dg) if dg else (1.0 if not dr else 0.0))
        if score < worst_score:
            worst, worst_score = i, score
    recall = matched / n_ref if n_ref else 1.0
    precision = matched / n_got if n_got else (1.0 if n_ref == 0 else 0.0)
    return TaskAgreement("detection", {"recall": recall, "precision": precision,
                                       "reference_detections": float(n_ref), "detections": float(n_got)},
                         worst, f"{matched} of {n_ref} reference detections matched at IoU {min_iou:g} or more")


def mask_iou(a: np.ndarray, b: np.ndarray, threshold: float) -> float:
    """IoU of two probability maps thresholded at `threshold`; two empty masks agree fully."""
    ma, mb = np.asarray(a) > threshold, np.asarray(b) > threshold
    union = int(np.logical_or(ma, mb).sum())
    return 1.0 if union == 0 else int(np.logical_and(ma, mb).sum()) / union


def _map_of(spec: PostprocessSpec, outputs: Outputs) -> np.ndarray:
    """One sample's (H, W) map: the declared channel of (C, H, W), or (H, W, 1), or (H, W)."""
    name = spec.output or next(iter(outputs))
    x = np.asarray(outputs[name], dtype=np.float64)
    channel = int(getattr(spec, "channel", 0) or 0)
    while x.ndim > 3 and x.shape[0] == 1:
        x = x[0]
    if x.ndim == 3:
        x = x[..., 0] if x.shape[-1] == 1 and x.shape[0] != 1 else x[min(channel, x.shape[0] - 1)]
    return np.nan_to_num(x, nan=-np.inf)


def segmentation_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> TaskAgreement:
    threshold = float(getattr(spec, "threshold", 0.3))
    ious = [mask_iou(_map_of(spec, g), _map_of(spec, r), threshold) for g, r in zip(got, ref)]
    worst = int(np.argmin(ious)) if ious else None
    return TaskAgreement("segmentation", {"mask_iou": float(np.mean(ious)) if ious else 1.0,
                                          "min_mask_iou": min(ious) if ious else 1.0},
                         worst, f"maps thresholded at {threshold:g}")


def channel_snr(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> TaskAgreement:
    """Worst channel's signal-to-noise ratio (dB) over the raw outputs, channels along the declared
    axis: a score channel drowned by a coordinate channel's quantisation step shows here."""
    axis = channel_axis(spec)
    names = tuple(getattr(spec, "outputs", ()) or ()) or tuple(ref[0]) if ref else ()
    worst_db, where, worst_sample = SNR_CAP_DB, "", None
    pieces: list[tuple[str, int, np.ndarray, np.ndarray]] = []
    for name in names:
        try:
            got_n = [np.asarray(g[name], dtype=np.float64) for g in got]
            ref_n = [np.asarray(x[name], dtype=np.float64) for x in ref]
        except KeyError:
            continue
        if len({x.shape for x in got_n + ref_n}) == 1 and got_n:
            pieces.append((name, 0, np.stack(got_n), np.stack(ref_n)))
        else:  # shapes that follow each frame's size: sample by sample (a stack would fail and judge nothing)
            pieces += [(name, i, a[None], r[None]) for i, (a, r) in enumerate(zip(got_n, ref_n)) if a.shape == r.shape]
    for name, first, a, r in pieces:
        ca, cr = _channel_view(a, axis), _channel_view(r, axis)
        ax = _batched_axis(axis, a.ndim)
        ax = ax if ax is not None and 1 <= ax < a.ndim else None
        with np.errstate(all="ignore"):
            err = np.nan_to_num((ca - cr) ** 2, nan=np.inf).sum(axis=1)
            # Each channel against its own energy only: a floor borrowed from louder channels would hide
            # exactly the fault this exists for (scores under a coordinate-sized quantisation step).
            sig = (cr ** 2).sum(axis=1)
            db = np.where(err == 0, SNR_CAP_DB, 10 * np.log10(np.maximum(sig, 1e-300) / np.maximum(err, 1e-300)))
        db = np.clip(np.nan_to_num(db, nan=-SNR_CAP_DB, posinf=SNR_CAP_DB, neginf=-SNR_CAP_DB), -SNR_CAP_DB, SNR_CAP_DB)
        c = int(np.argmin(db))
        if db[c] < worst_db:
            worst_db = float(db[c])
            where = f"output {name} channel {c}" if ax is not None else f"output {name}"
            per_sample = np.moveaxis(a - r, ax, 1) if ax is not None else (a - r)
            sel = per_sample[:, c] if ax is not None else per_sample
            worst_sample = first + int(np.argmax(np.nan_to_num(np.abs(sel.reshape(len(a), -1)), nan=np.inf).max(axis=1)))
    return TaskAgreement("raw", {"min_channel_snr_db": worst_db}, worst_sample,
                         f"worst at {where}" if where else "")


DEFAULT_DECISION_AGREEMENT = 0.98


def decision_task_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> TaskAgreement:
    """raw with a declared decision: what the bundle publishes is the decision, so its fidelity is the share
    of frames deciding as the reference does (not the SNR of channels nobody reads)."""
    from agent.vocabulary.decisions import decide

    flips = [i for i, (g, r) in enumerate(zip(got, ref)) if decide(spec, g).class_id != decide(spec, r).class_id]
    share = 1.0 - len(flips) / len(got) if got else 1.0
    return TaskAgreement("raw", {"decision_agreement": share}, flips[0] if flips else None,
                         f"{len(flips)} of {len(got)} frames decide otherwise")


def task_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs],
                   negligible_margin: float = 0.02) -> TaskAgreement:
    if spec.type == "raw" and getattr(spec, "decision", None) is not None:
        return decision_task_agreement(spec, got, ref)
    if spec.type == "classification":
        return classification_agreement(spec, got, ref, negligible_margin)
    if spec.type == "detection":
        return detection_agreement(spec, got, ref)
    if spec.type == "segmentation":
        return segmentation_agreement(spec, got, ref)
    return channel_snr(spec, got, ref)


def agreement_score(a: TaskAgreement) -> float:
    """The one decoded-agreement number reproduction bounds: the Wilson upper bound for top-1 (so a
    single flip among few samples is not a cliff), min(recall, precision), mean mask IoU."""
    m = a.metrics
    if a.task == "classification":
        return m["top1_wilson_high"] if m["top1_agreement"] < 1.0 else 1.0
    if a.task == "detection":
        return min(m["recall"], m["precision"])
    if a.task == "segmentation":
        return m["mask_iou"]
    if "decision_agreement" in m:
        return m["decision_agreement"]
    return 1.0  # raw: the tensor bound is the decoded result


# ---------------------------------------------------------------- the two questions
