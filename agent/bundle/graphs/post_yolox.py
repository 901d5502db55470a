"""Anchor-free grid/stride decode (YOLOX's demo_postprocess) -> `boxes`, `scores`, `class_ids` in frame pixels.

The model output [1, N, 5 + C] holds, per grid cell of each stride, (dx, dy, log w, log h, objectness,
class scores): centre = (d + grid) * stride, size = exp(log) * stride, score = objectness x class score.
Then multiclass NMS (class-agnostic like YOLOX's demo, or per class), boxes mapped through `geometry`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.frame_boxes import NMS_PARAMS, box_outputs, frame_inputs, nms, to_frame
from agent.bundle.graphs.params import Param, describe
from agent.errors import UsageError

PARAMS: dict[str, dict[str, Param]] = {
    "post.yolox": {
        "input": Param("str", "output", "the model output [1, N, 5 + C] (raw head, decode_in_inference off)"),
        "width": Param("int", 640, "model input width the grids are laid on (0: native, from frame_size)",
                       minimum=0),
        "height": Param("int", 640, "model input height (0: native, from frame_size)", minimum=0),
        "multiple": Param("int", 32, "native size only: the pre graph padded the frame to a multiple of this",
                          minimum=1),
        "strides": Param("ints", (8, 16, 32), "grid strides, in the head's output order", minimum=1),
        "decoded": Param("bool", False, "the output already holds (cx, cy, w, h) in input pixels (YOLOX exported "
                         "with decode_in_inference, YOLOv5's output): no grid decode"),
        "logits": Param("bool", False, "objectness and class scores are logits (apply sigmoid); YOLOX's export "
                        "already applies it"),
        "class_agnostic": Param("bool", True, "one NMS over each box's best class (YOLOX demo) or one per class"),
        **NMS_PARAMS,
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    if (p["width"] == 0) != (p["height"] == 0):
        raise UsageError(f"recipe {recipe}: --param width/height: both sizes or both 0 (native), found "
                         f"{p['width']}x{p['height']}")
    if not p["strides"] or min(p["strides"]) < 1:
        raise UsageError(f"recipe {recipe}: --param strides: expected positive strides, found {p['strides']}")
    g = Graph(recipe.replace(".", "_"))
    head = g.squeeze(g.input(p["input"], FLOAT, [1, "candidates", "fields"]), [0])  # [N, 5 + C]
    frame_size, geometry = frame_inputs(g)
    if p["decoded"]:
        xy, wh = g.slice(head, [0], [2], [1]), g.slice(head, [2], [4], [1])
    else:
        xy, wh = _grid_decode(g, head, p, frame_size)
    obj, cls = g.slice(head, [4], [5], [1]), g.slice(head, [5], [2**62], [1])
    if p["logits"]:
        obj, cls = g.op("Sigmoid", obj), g.op("Sigmoid", cls)
    scores = g.op("Mul", obj, cls)  # [N, C]
    half = g.op("Div", wh, g.const(2.0, FLOAT))
    boxes = to_frame(g, g.concat([g.op("Sub", xy, half), g.op("Add", xy, half)], 1), geometry, 2)
    if p["class_agnostic"]:
        best = g.op("ReduceMax", scores, axes=[1], keepdims=0)  # [N]
        classes = g.op("ArgMax", scores, axis=1, keepdims=0)
        picked = g.squeeze(g.slice(nms(g, boxes, g.unsqueeze(best, [0]), p), [2], [3], [1]), [1])
        out_scores, out_classes = g.gather(best, picked), g.gather(classes, picked)
    else:
        selected = nms(g, boxes, g.op("Transpose", scores, perm=[1, 0]), p)
        picked = g.squeeze(g.slice(selected, [2], [3], [1]), [1])
        out_classes = g.squeeze(g.slice(selected, [1], [2], [1]), [1])
        out_scores = g.op("GatherND", scores, g.concat([g.unsqueeze(picked, [1]), g.unsqueeze(out_classes, [1])], 1))
    out_boxes = g.gather(boxes, picked)
    box_outputs(g, out_boxes, out_scores, out_classes, frame_size, p["clip"])
    return g.model(f"{recipe}: {describe(p)}")


def _grid_decode(g: Graph, head: str, p: dict[str, Any], frame_size: str) -> tuple[str, str]:
    """demo_postprocess: centres (d + grid) * stride and sizes exp(d) * stride, [N, 2] each."""
    in_h, in_w = input_size(g, p, frame_size)
    grids, strides = [], []
    for s in p["strides"]:
        sc = g.const([s], INT64)
        gh, gw = g.op("Div", in_h, sc), g.op("Div", in_w, sc)  # YOLOX: img_size // stride
        xs = g.op("Range", g.const(0, INT64), g.squeeze(gw, [0]), g.const(1, INT64))
        ys = g.op("Range", g.const(0, INT64), g.squeeze(gh, [0]), g.const(1, INT64))
        hw = g.concat([gh, gw], 0)
        xv = g.op("Expand", g.unsqueeze(xs, [0]), hw)  # meshgrid(arange(w), arange(h)): x varies fastest
        yv = g.op("Expand", g.unsqueeze(ys, [1]), hw)
        grid = g.reshape(g.concat([g.unsqueeze(xv, [2]), g.unsqueeze(yv, [2])], 2), [-1, 2])
        grids.append(grid)
        strides.append(g.op("Expand", g.const([[float(s)]], FLOAT), g.concat([g.op("Mul", gh, gw),
                                                                               g.const([1], INT64)], 0)))
    grid = g.cast(g.concat(grids, 0), FLOAT)
    stride = g.concat(strides, 0)  # [N, 1]
    xy = g.op("Mul", g.op("Add", g.slice(head, [0], [2], [1]), grid), stride)
    return xy, g.op("Mul", g.op("Exp", g.slice(head, [2], [4], [1])), stride)


def input_size(g: Graph, p: dict[str, Any], frame_size: str) -> tuple[str, str]:
    """The model input's (h, w) as int64 [1] each: fixed, or native (the frame padded up to `multiple`)."""
    if p["width"]:
        return g.const([p["height"]], INT64), g.const([p["width"]], INT64)
    m = p["multiple"]
    if m < 1:
        raise UsageError(f"--param multiple: expected an integer >= 1, found {m}")
    mc = g.const([m], INT64)
    up = g.op("Mul", g.op("Div", g.op("Add", frame_size, g.const([m - 1], INT64)), mc), mc)
    return g.gather(up, [0]), g.gather(up, [1])
