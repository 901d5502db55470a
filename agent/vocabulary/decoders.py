"""Decoders from model outputs to compact results, chosen by the bundle's postprocess type and layout.

A registry keyed by type, so a new task adds one function. Pure over numpy arrays (OpenCV for NMS and
connected regions). A result is a small JSON-safe dict, never a full tensor; `check_result_size`
turns an oversize one into an error instead of a multi-megabyte message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeGuard

import cv2
import numpy as np

from agent.errors import ResultTooLargeError
from agent.vocabulary.decisions import decision_record
from agent.vocabulary.manifest import PostprocessSpec
from agent.vocabulary.preprocess import IDENTITY, Geometry

Outputs = Mapping[str, np.ndarray]

DEFAULT_MAX_RESULT_BYTES = 65536


@dataclass(frozen=True)
class Detection:
    box: tuple[float, float, float, float]  # x1, y1, x2, y2
    class_id: int
    score: float


@dataclass(frozen=True)
class Region:
    """A connected region of a thresholded probability map, in frame pixels."""

    box: tuple[float, float, float, float]
    score: float  # mean probability inside the region
    area: int  # map pixels


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    out: np.ndarray = e / np.sum(e, axis=axis, keepdims=True)
    return out


def class_scores(spec: PostprocessSpec, outputs: Outputs) -> np.ndarray:
    """(classes,) scores of one sample: softmax of logits unless the bundle says they are scores."""
    name = spec.output or next(iter(outputs))
    logits = np.asarray(outputs[name], dtype=np.float32).reshape(-1)
    if logits.size == 1:  # one output is a binary classifier's logit (or probability): classes 0 and 1
        p = 1.0 / (1.0 + np.exp(-logits)) if spec.apply_softmax else logits
        return np.concatenate([1.0 - p, p]).astype(np.float32)
    return softmax(logits) if spec.apply_softmax else logits


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a (N,4) with every box in b (M,4), xyxy."""
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, class_ids: np.ndarray | None = None,
        top_k: int = 0) -> list[int]:
    """Indices kept by greedy NMS (per class when class_ids is given), best score first. OpenCV's."""
    if len(boxes) == 0:
        return []
    xywh = np.empty((len(boxes), 4), np.float64)
    xywh[:, :2] = boxes[:, :2]
    xywh[:, 2:] = boxes[:, 2:] - boxes[:, :2]
    s = scores.astype(np.float32)
    # OpenCV keeps scores strictly over a threshold >= 0; the caller thresholded already, so shift every
    # score above 0 (order-preserving) and let every box be a candidate.
    shifted = (s.astype(np.float64) - float(s.min()) + 1.0).tolist()
    if class_ids is None:
        keep = cv2.dnn.NMSBoxes(xywh.tolist(), shifted, 0.0, float(iou_threshold), top_k=top_k)
    else:
        keep = cv2.dnn.NMSBoxesBatched(xywh.tolist(), shifted, class_ids.astype(np.int32).tolist(), 0.0,
                                       float(iou_threshold), top_k=top_k)
    idx = np.asarray(keep, dtype=np.int64).reshape(-1)
    return [int(i) for i in idx[np.argsort(-s[idx], kind="stable")]]


def _cxcywh_to_xyxy(b: np.ndarray) -> np.ndarray:
    out = np.empty_like(b)
    out[:, :2] = b[:, :2] - b[:, 2:4] / 2
    out[:, 2:] = b[:, :2] + b[:, 2:4] / 2
    return out


def _sample_2d(outputs: Outputs, name: str | None) -> np.ndarray:
    a = np.asarray(outputs[name or next(iter(outputs))], dtype=np.float32)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    return a.reshape(a.shape[0], -1) if a.ndim != 2 else a


def candidates(spec: PostprocessSpec, outputs: Outputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sample's (boxes xyxy in input pixels, best score, class id) per anchor, before any threshold."""
    layout = spec.layout
    if layout == "boxes_scores":
        assert spec.boxes_output is not None and spec.scores_output is not None  # the manifest requires both here
        boxes = np.asarray(outputs[spec.boxes_output], dtype=np.float32).reshape(-1, 4)
        scores = np.asarray(outputs[spec.scores_output], dtype=np.float32).reshape(boxes.shape[0], -1)
        if spec.box_format == "cxcywh":
            boxes = _cxcywh_to_xyxy(boxes)
    elif layout == "yolov5":  # [N, 5+C]: cx, cy, w, h, objectness, class scores
        a = _sample_2d(outputs, spec.output)
        boxes = _cxcywh_to_xyxy(a[:, :4])
        scores = a[:, 5:] * a[:, 4:5]
    elif layout == "yolov8":  # [4+C, N]: cx, cy, w, h, class scores (no objectness)
        a = _sample_2d(outputs, spec.output).T
        boxes = _cxcywh_to_xyxy(a[:, :4])
        scores = a[:, 4:]
    elif layout == "end2end":  # [N, 6]: x1, y1, x2, y2, score, class (NMS already in the graph)
        a = _sample_2d(outputs, spec.output)
        return a[:, :4].copy(), a[:, 4].copy(), a[:, 5].astype(np.int64)
    else:
        raise ValueError(f"unknown detection layout {layout!r}")
    if scores.shape[1] == 0:
        return boxes, np.zeros(len(boxes), np.float32), np.zeros(len(boxes), np.int64)
    cls = np.argmax(scores, axis=1)
    best = scores[np.arange(len(cls)), cls]
    return boxes, best, cls


def decode_detections(spec: PostprocessSpec, outputs: Outputs, geometry: Geometry = IDENTITY) -> list[Detection]:
    """One sample's outputs in the declared layout -> thresholded, NMS'd detections in frame pixels."""
    boxes, best, cls = candidates(spec, outputs)
    # a non-finite box or score is no detection (and would make the result invalid JSON)
    mask = (best >= spec.score_threshold) & np.isfinite(best) & np.isfinite(boxes).all(axis=1)
    boxes, cls, best = boxes[mask], cls[mask], best[mask]
    if spec.layout == "end2end":
        keep = list(np.argsort(-best, kind="stable"))
    else:
        keep = nms(boxes, best, spec.iou_threshold, None if spec.class_agnostic else cls)
    keep = keep[: spec.max_detections]
    if not keep:
        return []
    kept = boxes[keep]
    if geometry is not IDENTITY:
        kept = geometry.to_frame(kept)
    return [Detection(_box(b), int(cls[j]), float(best[j])) for b, j in zip(kept, keep)]


def _box(b: np.ndarray) -> tuple[float, float, float, float]:
    return float(b[0]), float(b[1]), float(b[2]), float(b[3])


def probability_map(spec: PostprocessSpec, outputs: Outputs) -> np.ndarray:
    """One sample's (H, W) map: the declared channel of (C,H,W), (H,W,1) or (H,W) after the batch."""
    a = np.asarray(outputs[spec.output or next(iter(outputs))], dtype=np.float32)
    while a.ndim > 2 and a.shape[0] == 1 and a.ndim > 3:
        a = a[0]
    if a.ndim == 3:
        a = a[..., 0] if a.shape[-1] == 1 and a.shape[0] != 1 else a[min(spec.channel, a.shape[0] - 1)]
    if a.ndim != 2:
        raise ValueError(f"output {spec.output!r} of shape {a.shape} is not a probability map")
    return a


def segment_regions(spec: PostprocessSpec, prob: np.ndarray, geometry: Geometry = IDENTITY) -> tuple[list[Region], np.ndarray]:
    """Threshold a map, find 8-connected regions; boxes in frame pixels, best-scoring first. Also the mask."""
    mask: np.ndarray = (prob > spec.threshold).astype(np.uint8)
    if spec.dilation > 1:
        mask = cv2.dilate(mask, np.ones((spec.dilation, spec.dilation), np.uint8))
    n, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    if n <= 1:
        return [], mask
    sums = np.bincount(labels.ravel(), weights=prob.ravel().astype(np.float64), minlength=n)
    areas = stats[:, cv2.CC_STAT_AREA]
    score = sums / np.maximum(areas, 1)
    if spec.region_score == "box_mean":
        # the mean over each component's bounding box, from an integral image (DBNet's box_score_fast)
        ii = cv2.integral(prob.astype(np.float64))
        x0, y0 = stats[:, cv2.CC_STAT_LEFT], stats[:, cv2.CC_STAT_TOP]
        x1, y1 = x0 + stats[:, cv2.CC_STAT_WIDTH], y0 + stats[:, cv2.CC_STAT_HEIGHT]
        box_sums = ii[y1, x1] - ii[y0, x1] - ii[y1, x0] + ii[y0, x0]
        score = box_sums / np.maximum((x1 - x0) * (y1 - y0), 1)
    ids = [i for i in range(1, n) if areas[i] >= spec.min_area and score[i] >= spec.min_score]
    if not ids:
        return [], mask
    ids.sort(key=lambda i: -score[i])
    ids = ids[: spec.max_regions]
    st = stats[ids]
    boxes = np.stack([st[:, 0], st[:, 1], st[:, 0] + st[:, 2], st[:, 1] + st[:, 3]], axis=1).astype(np.float32)
    if spec.unclip_ratio > 0:
        # DBNet's unclip for a rectangle: offset = area * ratio / perimeter, on every side
        w, h = st[:, 2].astype(np.float32), st[:, 3].astype(np.float32)
        d = (w * h * spec.unclip_ratio / (2 * (w + h)))[:, None]
        boxes = boxes + np.concatenate([-d, -d, d, d], axis=1)
        boxes = np.clip(boxes, 0, [prob.shape[1], prob.shape[0], prob.shape[1], prob.shape[0]]).astype(np.float32)
    # a map smaller than the model input (a stride-4 head) covers the same field: scale to input pixels
    h, w = prob.shape
    if geometry.input_w and geometry.input_h and (w, h) != (geometry.input_w, geometry.input_h):
        boxes[:, [0, 2]] *= geometry.input_w / w
        boxes[:, [1, 3]] *= geometry.input_h / h
    if geometry is not IDENTITY:
        boxes = geometry.to_frame(boxes)
    return [Region(_box(b), float(score[i]), int(areas[i])) for b, i in zip(boxes, ids)], mask


def mask_iou(spec: PostprocessSpec, got: Outputs, ref: Outputs) -> float:
    """IoU of the thresholded maps of one sample (1.0 when both are empty): segmentation agreement."""
    a = probability_map(spec, got) > spec.threshold
    b = probability_map(spec, ref) > spec.threshold
    if a.shape != b.shape:
        return 0.0
    union = int(np.count_nonzero(a | b))
    return 1.0 if union == 0 else int(np.count_nonzero(a & b)) / union


def rle(mask: np.ndarray) -> dict[str, Any]:
    """Row-major run lengths of a 0/1 mask, starting with a run of zeros (0 when it starts with a one)."""
    flat = mask.ravel().astype(np.int8)
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate(([0], change, [flat.size]))
    counts = np.diff(bounds).tolist()
    if flat.size and flat[0] == 1:
        counts = [0, *counts]
    return {"format": "rle", "size": [int(mask.shape[0]), int(mask.shape[1])], "counts": counts}


def layout_problems(spec: PostprocessSpec, shapes: Mapping[str, Sequence[int | str]]) -> list[str]:
    """What is wrong with the declared postprocess layout for these real output shapes (symbolic dims pass)."""
    def known(d: int | str | None) -> TypeGuard[int]:
        return isinstance(d, int)

    out: list[str] = []
    p = spec
    if p.type == "detection" and p.layout == "boxes_scores":
        if p.boxes_output == p.scores_output:
            out.append(f"postprocess.boxes_output and scores_output are both {p.boxes_output!r}: one tensor cannot be "
                       "both; a single-output YOLO export is layout yolov5 or yolov8 with output")
            return out
        b, sc = shapes.get(p.boxes_output or ""), shapes.get(p.scores_output or "")
        if b is not None and (not b or (known(b[-1]) and b[-1] != 4)):
            out.append(f"postprocess.boxes_output {p.boxes_output!r} has shape {list(b)}; boxes_scores wants (batch, anchors, 4)")
        if b is not None and sc is not None and len(b) >= 2 and len(sc) >= 2 and known(b[-2]) and known(sc[-2]) \
                and b[-2] != sc[-2]:
            out.append(f"postprocess: boxes {list(b)} and scores {list(sc)} disagree on the number of anchors")
    elif p.type == "detection":
        a = shapes.get(p.output or "")
        if a is None:
            return out
        if len(a) != 3:
            out.append(f"postprocess.output {p.output!r} has shape {list(a)}; layout {p.layout} wants a rank-3 tensor")
        elif p.layout == "yolov5" and known(a[2]) and (a[2] < 6 or (known(a[1]) and a[2] > a[1])):
            out.append(f"postprocess.output {p.output!r} has shape {list(a)}; yolov5 wants (batch, anchors, 5 + classes)"
                       + (" — this looks transposed (anchors last): that is layout yolov8" if known(a[1]) and a[2] > a[1]
                          else ""))
        elif p.layout == "yolov8" and known(a[1]) and (a[1] < 5 or (known(a[2]) and a[1] > a[2])):
            out.append(f"postprocess.output {p.output!r} has shape {list(a)}; yolov8 wants (batch, 4 + classes, anchors)"
                       + (" — this looks transposed (anchors first): layout yolov5 has objectness, or transpose the "
                          "export" if known(a[2]) and a[1] > a[2] else ""))
        elif p.layout == "end2end" and known(a[2]) and a[2] != 6:
            out.append(f"postprocess.output {p.output!r} has shape {list(a)}; end2end wants (batch, detections, 6): "
                       "x1, y1, x2, y2, score, class")
    elif p.type == "segmentation":
        a = shapes.get(p.output or "")
        if a is not None and len(a) not in (3, 4):
            out.append(f"postprocess.output {p.output!r} has shape {list(a)}; a probability map is (batch, [C,] H, W)")
        elif a is not None and len(a) == 4 and known(a[1]) and a[1] != 1 and known(a[3]) and a[3] != 1 \
                and p.channel >= a[1]:
            out.append(f"postprocess.channel {p.channel} is beyond the {a[1]} channels of {p.output!r} {list(a)}")
    return out


def _label(labels: Sequence[str], i: int) -> str:
    return labels[i] if 0 <= i < len(labels) else str(i)


def _finite(v: float, digits: int) -> float | None:
    return round(v, digits) if math.isfinite(v) else None


def _classification(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Geometry) -> dict[str, Any]:
    scores = class_scores(spec, outputs)
    k = min(spec.top_k, scores.shape[0])
    top = np.argsort(-scores, kind="stable")[:k]
    return {
        "type": "classification",
        "top": [{"class_id": int(i), "label": _label(labels, int(i)), "score": _finite(float(scores[i]), 6)} for i in top],
    }


def _detection(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Geometry) -> dict[str, Any]:
    dets = decode_detections(spec, outputs, geometry)
    return {
        "type": "detection",
        "detections": [
            {"box": [round(v, 2) for v in d.box], "class_id": d.class_id, "label": _label(labels, d.class_id),
             "score": round(d.score, 6)}
            for d in dets
        ],
    }


def _segmentation(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Geometry) -> dict[str, Any]:
    regions, mask = segment_regions(spec, probability_map(spec, outputs), geometry)
    result: dict[str, Any] = {
        "type": "segmentation",
        "regions": [{"box": [_finite(v, 2) for v in r.box], "score": _finite(r.score, 6), "area": r.area}
                    for r in regions],
    }
    if spec.mask == "rle":
        result["mask"] = rle(mask)
    return result


def _raw(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Geometry) -> dict[str, Any]:
    """A declared summary: each selected output's shape and its first max_values values, never the tensor;
    with a declared decision, the frame's decision first (and no arrays when max_values is 0)."""
    summary: dict[str, Any] = {}
    if spec.decision is not None:
        decided = {"type": "raw", "decision": decision_record(spec, outputs)}
        if spec.max_values == 0:
            return decided
    for n in spec.outputs or tuple(outputs):
        a = np.asarray(outputs[n])
        flat = a.reshape(-1)[: spec.max_values]
        values = [_finite(float(v), 6) for v in flat.astype(np.float64)]
        summary[n] = {"shape": list(a.shape), "values": values, "truncated": bool(a.size > spec.max_values)}
    if spec.decision is not None:
        return {**decided, "outputs": summary}
    return {"type": "raw", "outputs": summary}


Decoder = Callable[[PostprocessSpec, Outputs, Sequence[str], Geometry], dict[str, Any]]

DECODERS: dict[str, Decoder] = {
    "classification": _classification,
    "detection": _detection,
    "segmentation": _segmentation,
    "raw": _raw,
}


def result_bytes(result: Mapping[str, Any]) -> int:
    return len(json.dumps(result, separators=(",", ":"), allow_nan=False).encode())


def check_result_size(result: Mapping[str, Any], max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
    """Raise ResultTooLargeError when a result would make a message over `max_bytes` (0 = no cap)."""
    if max_bytes <= 0:
        return
    size = result_bytes(result)
    if size > max_bytes:
        raise ResultTooLargeError(
            f"{result.get('type')} result is {size} bytes, over output.max_result_bytes = {max_bytes}: lower "
            "postprocess max_values / max_regions / max_detections, drop the mask, or raise the cap"
        )


def decode(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str] = (), geometry: Geometry = IDENTITY,
           max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> dict[str, Any]:
    """One sample's outputs (no batch dimension needed) -> a JSON-ready result of at most max_bytes."""
    result = DECODERS[spec.type](spec, outputs, labels, geometry)
    check_result_size(result, max_bytes)
    return result


def split_batch(outputs: Mapping[str, np.ndarray], index: int,
                axes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Sample `index` of batched outputs: each output's slice on its batch axis (axis 0 unless `axes`, the
    manifest's `batch_axes`, names another: a time-major [T, B, C] output is sliced on axis 1, to [T, C])."""
    if not axes:
        return {k: v[index] for k, v in outputs.items()}
    # moveaxis then index: a view, as v[index] is (np.take would copy every frame's slice)
    return {k: np.moveaxis(v, axes[k], 0)[index] if axes.get(k) else v[index] for k, v in outputs.items()}
