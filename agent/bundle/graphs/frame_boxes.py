"""What every box post graph shares: the `frame_size`/`geometry` inputs, mapping input pixels back to frame
pixels, NonMaxSuppression (optionally with the legacy +1 pixel area of py_cpu_nms) and the final clip."""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.params import Param

NMS_PARAMS: dict[str, Param] = {
    "score_threshold": Param("float", 0.1, "keep candidates whose score is strictly above this"),
    "iou_threshold": Param("float", 0.45, "suppress a box whose IoU with a kept one is above this"),
    "max_detections": Param("int", 1000, "at most this many boxes (per class when class-aware)"),
    "legacy_plus_one": Param("bool", True, "IoU with (x2 - x1 + 1) * (y2 - y1 + 1) areas, as py_cpu_nms "
                             "(YOLOX demo_utils, Pytorch_Retinaface) computes it"),
    "clip": Param("bool", True, "clip boxes to frame_size (after NMS, so clipping never changes what is kept)"),
}


def frame_inputs(g: Graph) -> tuple[str, str]:
    return g.input("frame_size", INT64, [2]), g.input("geometry", FLOAT, [6])


def to_frame(g: Graph, xy: str, geometry: str, pairs: int) -> str:
    """Points [..., 2 * pairs] (x, y, x, y...) in model-input pixels -> frame pixels: (v - pad + crop) / scale."""
    sx, sy = [0, 1] * pairs, [2, 3] * pairs
    scale = g.gather(geometry, sx)
    offset = g.op("Sub", g.gather(geometry, [4, 5] * pairs), g.gather(geometry, sy))
    return g.op("Div", g.op("Add", xy, offset), scale)


def clip_boxes(g: Graph, boxes: str, frame_size: str) -> str:
    hi = g.cast(g.gather(frame_size, [1, 0, 1, 0]), FLOAT)
    return g.op("Max", g.op("Min", boxes, hi), g.const(0.0, FLOAT))


def box_outputs(g: Graph, boxes: str, scores: str, classes: str, frame_size: str, clip: bool) -> None:
    """The boxes kind's outputs of a box recipe: `boxes` (clipped to the frame when asked), `scores` and, where
    the recipe has classes, `class_ids`, one row per detection."""
    if clip:
        boxes = clip_boxes(g, boxes, frame_size)
    g.output(boxes, "boxes", FLOAT, ["detections", 4])
    g.output(scores, "scores", FLOAT, ["detections"])
    if classes:
        g.output(classes, "class_ids", INT64, ["detections"])


def nms(g: Graph, boxes: str, scores: str, p: dict[str, Any]) -> str:
    """boxes [N, 4] xyxy, scores [C, N] -> selected [K, 3] (batch, class, box), per class in score order."""
    b = g.op("Add", boxes, g.const([0.0, 0.0, 1.0, 1.0], FLOAT)) if p["legacy_plus_one"] else boxes
    return g.op("NonMaxSuppression", g.unsqueeze(b, [0]), g.unsqueeze(scores, [0]),
                g.const([p["max_detections"]], INT64), g.const([p["iou_threshold"]], FLOAT),
                g.const([p["score_threshold"]], FLOAT), center_point_box=0)
