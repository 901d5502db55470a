"""SSD/RetinaFace prior-box decode with variances (+ 5 landmarks) -> `boxes`, `scores`, `keypoints`.

Priors as Pytorch_Retinaface's PriorBox: for each step k, each feature-map cell (i, j) of
ceil(input / step), each min size: centre ((j + 0.5) * step, (i + 0.5) * step), size min_size (in input
pixels). decode: centre = prior_c + loc_xy * v0 * prior_wh, size = prior_wh * exp(loc_wh * v1);
decode_landm: point = prior_c + l * v0 * prior_wh. Then pre-NMS top-k, NMS, keep-top-k, through `geometry`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.frame_boxes import NMS_PARAMS, clip_boxes, frame_inputs, nms, to_frame
from agent.bundle.graphs.params import Param
from agent.bundle.graphs.post_yolox import input_size
from agent.errors import UsageError

PARAMS: dict[str, dict[str, Param]] = {
    "post.priors": {
        "loc": Param("str", "loc", "the model output of box offsets [1, P, 4]"),
        "conf": Param("str", "conf", "the model output of class scores [1, P, classes]"),
        "landmarks": Param("str", "landms", "the model output of landmark offsets [1, P, 2 * keypoints] ('' for none)"),
        "keypoints": Param("int", 5, "landmarks per box"),
        "width": Param("int", 640, "model input width the priors are laid on (0: native, from frame_size)"),
        "height": Param("int", 640, "model input height (0: native)"),
        "multiple": Param("int", 1, "native size only: the pre graph padded the frame to a multiple of this"),
        "min_sizes": Param("int_lists", ((16, 32), (64, 128), (256, 512)), "prior sizes per step, ';' between steps"),
        "steps": Param("ints", (8, 16, 32), "feature-map strides"),
        "variances": Param("floats", (0.1, 0.2), "centre and size variances"),
        "score_index": Param("int", 1, "the conf column that is the score (1: face of background/face)"),
        "conf_softmax": Param("bool", False, "apply softmax to conf (the export has none)"),
        "pre_nms_top_k": Param("int", 5000, "keep the best this many candidates before NMS"),
        **NMS_PARAMS,
        "score_threshold": Param("float", 0.02, "keep candidates whose score is strictly above this"),
        "iou_threshold": Param("float", 0.4, "suppress a box whose IoU with a kept one is above this"),
        "max_detections": Param("int", 750, "keep at most this many after NMS (keep_top_k)"),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    if len(p["min_sizes"]) != len(p["steps"]) or not p["steps"]:
        raise UsageError(f"recipe {recipe}: --param min_sizes has {len(p['min_sizes'])} groups for "
                         f"{len(p['steps'])} steps: one group per step")
    if len(p["variances"]) != 2:
        raise UsageError(f"recipe {recipe}: --param variances: expected 2 numbers, found {len(p['variances'])}")
    g = Graph(recipe.replace(".", "_"))
    loc = g.squeeze(g.input(p["loc"], FLOAT, [1, "priors", 4]), [0])
    conf = g.squeeze(g.input(p["conf"], FLOAT, [1, "priors", "classes"]), [0])
    k = p["keypoints"]
    landms = g.squeeze(g.input(p["landmarks"], FLOAT, [1, "priors", 2 * k]), [0]) if p["landmarks"] else ""
    frame_size, geometry = frame_inputs(g)
    centres, sizes = _priors(g, p, frame_size)
    v0, v1 = (g.const(float(v), FLOAT) for v in p["variances"])

    cxcy = g.op("Add", centres, g.op("Mul", g.op("Mul", g.slice(loc, [0], [2], [1]), v0), sizes))
    wh = g.op("Mul", sizes, g.op("Exp", g.op("Mul", g.slice(loc, [2], [4], [1]), v1)))
    x1y1 = g.op("Sub", cxcy, g.op("Div", wh, g.const(2.0, FLOAT)))
    boxes = to_frame(g, g.concat([x1y1, g.op("Add", x1y1, wh)], 1), geometry, 2)  # boxes[:, 2:] += boxes[:, :2]
    if p["conf_softmax"]:
        conf = g.op("Softmax", conf, axis=1)
    scores = g.squeeze(g.slice(conf, [p["score_index"]], [p["score_index"] + 1], [1]), [1])  # [P]

    n = g.op("Shape", scores)
    top = g.op("Min", n, g.const([p["pre_nms_top_k"]], INT64))
    top_scores, top_idx = g.op("TopK", scores, top, n_out=2, axis=0, largest=1, sorted=1)
    top_boxes = g.gather(boxes, top_idx)
    picked = g.squeeze(g.slice(nms(g, top_boxes, g.unsqueeze(top_scores, [0]), p), [2], [3], [1]), [1])
    out_boxes = g.gather(top_boxes, picked)
    if p["clip"]:
        out_boxes = clip_boxes(g, out_boxes, frame_size)
    g.output(out_boxes, "boxes", FLOAT, ["detections", 4])
    g.output(g.gather(top_scores, picked), "scores", FLOAT, ["detections"])
    if landms:
        c = g.unsqueeze(centres, [1])  # [P, 1, 2]
        pts = g.op("Add", c, g.op("Mul", g.op("Mul", g.reshape(landms, [-1, k, 2]), v0), g.unsqueeze(sizes, [1])))
        pts = g.reshape(to_frame(g, g.reshape(pts, [-1, 2 * k]), geometry, k), [-1, k, 2])
        g.output(g.gather(g.gather(pts, top_idx), picked), "keypoints", FLOAT, ["detections", k, 2])
    return g.model(f"{recipe}: " + ", ".join(f"{key}={v}" for key, v in sorted(p.items())))


def _priors(g: Graph, p: dict[str, Any], frame_size: str) -> tuple[str, str]:
    """Prior centres [P, 2] and sizes [P, 2] in input pixels, in PriorBox order (step, row, column, size)."""
    in_h, in_w = input_size(g, p, frame_size)
    centres, sizes = [], []
    for step, mins in zip(p["steps"], p["min_sizes"]):
        sc = g.const([step], INT64)
        fh = g.op("Div", g.op("Add", in_h, g.const([step - 1], INT64)), sc)  # ceil(h / step)
        fw = g.op("Div", g.op("Add", in_w, g.const([step - 1], INT64)), sc)
        a = len(mins)
        cells = g.concat([fh, fw, g.const([a], INT64)], 0)
        xs = g.op("Range", g.const(0, INT64), g.squeeze(fw, [0]), g.const(1, INT64))
        ys = g.op("Range", g.const(0, INT64), g.squeeze(fh, [0]), g.const(1, INT64))
        half = g.const(0.5, FLOAT)
        cx = g.op("Mul", g.op("Add", g.cast(xs, FLOAT), half), g.const(float(step), FLOAT))
        cy = g.op("Mul", g.op("Add", g.cast(ys, FLOAT), half), g.const(float(step), FLOAT))
        cxv = g.op("Expand", g.reshape(cx, [1, -1, 1]), cells)
        cyv = g.op("Expand", g.reshape(cy, [-1, 1, 1]), cells)
        side = g.op("Expand", g.const([[[float(m) for m in mins]]], FLOAT), cells)
        centres.append(g.reshape(g.concat([g.unsqueeze(cxv, [3]), g.unsqueeze(cyv, [3])], 3), [-1, 2]))
        sizes.append(g.reshape(g.concat([g.unsqueeze(side, [3]), g.unsqueeze(side, [3])], 3), [-1, 2]))
    return g.concat(centres, 0), g.concat(sizes, 0)
