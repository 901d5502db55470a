"""Decoders from model outputs to results, chosen by the bundle's postprocess type.

A registry keyed by type, so a new task adds one function. Pure over numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from agent.spec.manifest import PostprocessSpec
from agent.spec.preprocess import IDENTITY, Letterbox

Outputs = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Detection:
    box: tuple[float, float, float, float]  # x1, y1, x2, y2
    class_id: int
    score: float


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def class_scores(spec: PostprocessSpec, outputs: Outputs) -> np.ndarray:
    """(classes,) scores of one sample: softmax of logits unless the bundle says they are scores."""
    name = spec.output or next(iter(outputs))
    logits = np.asarray(outputs[name], dtype=np.float32).reshape(-1)
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


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> list[int]:
    order = list(np.argsort(-scores, kind="stable"))
    keep: list[int] = []
    while order:
        i = order.pop(0)
        keep.append(int(i))
        if not order:
            break
        rest = np.asarray(order)
        overlaps = iou(boxes[i : i + 1], boxes[rest])[0]
        order = [int(j) for j, o in zip(rest, overlaps) if o <= iou_threshold]
    return keep


def decode_detections(spec: PostprocessSpec, outputs: Outputs, geometry: Letterbox = IDENTITY) -> list[Detection]:
    """One sample's boxes (anchors,4) and scores (anchors,classes) -> thresholded, per-class NMS."""
    boxes = np.asarray(outputs[spec.boxes_output], dtype=np.float32).reshape(-1, 4)
    scores = np.asarray(outputs[spec.scores_output], dtype=np.float32)
    scores = scores.reshape(boxes.shape[0], -1)
    cls = np.argmax(scores, axis=1)
    best = scores[np.arange(len(cls)), cls]
    mask = best >= spec.score_threshold
    boxes, cls, best = boxes[mask], cls[mask], best[mask]
    found: list[Detection] = []
    for c in np.unique(cls):
        idx = np.flatnonzero(cls == c)
        for k in nms(boxes[idx], best[idx], spec.iou_threshold):
            j = idx[k]
            found.append(Detection(tuple(float(v) for v in boxes[j]), int(c), float(best[j])))
    found.sort(key=lambda d: -d.score)
    found = found[: spec.max_detections]
    if geometry is not IDENTITY and found:
        mapped = geometry.to_frame(np.asarray([d.box for d in found]))
        found = [Detection(tuple(float(v) for v in b), d.class_id, d.score) for b, d in zip(mapped, found)]
    return found


def _label(labels: Sequence[str], i: int) -> str:
    return labels[i] if 0 <= i < len(labels) else str(i)


def _classification(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Letterbox) -> dict[str, Any]:
    scores = class_scores(spec, outputs)
    k = min(spec.top_k, scores.shape[0])
    top = np.argsort(-scores, kind="stable")[:k]
    return {
        "type": "classification",
        "top": [{"class_id": int(i), "label": _label(labels, int(i)), "score": round(float(scores[i]), 6)} for i in top],
    }


def _detection(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Letterbox) -> dict[str, Any]:
    dets = decode_detections(spec, outputs, geometry)
    return {
        "type": "detection",
        "detections": [
            {"box": [round(v, 2) for v in d.box], "class_id": d.class_id, "label": _label(labels, d.class_id),
             "score": round(d.score, 6)}
            for d in dets
        ],
    }


def _raw(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str], geometry: Letterbox) -> dict[str, Any]:
    names = spec.outputs or tuple(outputs)
    return {"type": "raw", "outputs": {n: np.asarray(outputs[n]).tolist() for n in names}}


Decoder = Callable[[PostprocessSpec, Outputs, Sequence[str], Letterbox], dict[str, Any]]

DECODERS: dict[str, Decoder] = {
    "classification": _classification,
    "detection": _detection,
    "raw": _raw,
}


def decode(spec: PostprocessSpec, outputs: Outputs, labels: Sequence[str] = (), geometry: Letterbox = IDENTITY) -> dict[str, Any]:
    """One sample's outputs (no batch dimension needed) -> a JSON-ready result."""
    return DECODERS[spec.type](spec, outputs, labels, geometry)


def split_batch(outputs: Mapping[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in outputs.items()}
