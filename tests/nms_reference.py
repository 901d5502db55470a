"""Greedy NMS in plain numpy: the test-only yardstick `agent.vocabulary.decoders.nms` (OpenCV's) is checked against;
moved out of the production module (issue 18)."""

from __future__ import annotations

import numpy as np

from agent.vocabulary.decoders import iou


def nms_reference(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> list[int]:
    """Greedy NMS in plain numpy, one class: the yardstick `nms` is tested against. Quadratic in Python."""
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
