"""Saliency/probability map -> `mask` [H, W] at frame size (U2Net-style per-image min-max normalisation).

The map [1, C, h, w] (one channel used) is optionally sigmoided and min-max normalised per image
((d - min) / (max - min), U2Net's normPRED), then sampled bilinearly at each frame pixel's centre mapped
through `geometry` into the model input (so a stretch is a plain half-pixel resize, and a letterbox's pad
is never part of the mask). threshold > 0 gives a uint8 0/1 mask; otherwise the float map, for the masks
kind's `postprocess.result.threshold`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, UINT8, Graph
from agent.bundle.graphs.params import Param

PARAMS: dict[str, dict[str, Param]] = {
    "post.saliency": {
        "input": Param("str", "output", "the model output [1, C, h, w] holding the map"),
        "channel": Param("int", 0, "the channel of the map"),
        "sigmoid": Param("bool", False, "the map is logits: sigmoid first"),
        "normalize": Param("str", "minmax", "per-image minmax ((d - min) / (max - min)) or none", ("minmax", "none")),
        "width": Param("int", 0, "model input width the map covers (0: the map's own width)"),
        "height": Param("int", 0, "model input height (0: the map's own height)"),
        "threshold": Param("float", 0.0, "> 0: output a uint8 mask, 1 where the map is at or over this"),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    g = Graph(recipe.replace(".", "_"))
    x = g.input(p["input"], FLOAT, [1, "channels", "map_height", "map_width"])
    frame_size = g.input("frame_size", INT64, [2])
    geometry = g.input("geometry", FLOAT, [6])
    m = g.slice(x, [p["channel"]], [p["channel"] + 1], [1])  # [1, 1, h, w]
    if p["sigmoid"]:
        m = g.op("Sigmoid", m)
    if p["normalize"] == "minmax":
        lo, hi = g.op("ReduceMin", m, keepdims=0), g.op("ReduceMax", m, keepdims=0)
        m = g.op("Div", g.op("Sub", m, lo), g.op("Max", g.op("Sub", hi, lo), g.const(1e-12, FLOAT)))
    if p["width"]:
        in_w, in_h = g.const([float(p["width"])], FLOAT), g.const([float(p["height"] or p["width"])], FLOAT)
    else:
        shape = g.cast(g.op("Shape", m), FLOAT)
        in_w, in_h = g.gather(shape, [3]), g.gather(shape, [2])

    def axis(n: str, scale: int, pad: int, crop: int, size: str) -> str:
        """Normalised sample positions [-1, 1] of the n frame pixel centres along one axis."""
        centres = g.op("Add", g.cast(g.op("Range", g.const(0, INT64), g.squeeze(n, [0]), g.const(1, INT64)), FLOAT),
                       g.const(0.5, FLOAT))
        at = g.op("Add", g.op("Mul", centres, g.gather(geometry, [scale])),
                  g.op("Sub", g.gather(geometry, [pad]), g.gather(geometry, [crop])))
        return g.op("Sub", g.op("Div", g.op("Mul", at, g.const(2.0, FLOAT)), size), g.const(1.0, FLOAT))

    fh, fw = g.gather(frame_size, [0]), g.gather(frame_size, [1])
    gx, gy = axis(fw, 0, 2, 4, in_w), axis(fh, 1, 3, 5, in_h)
    hw = g.concat([fh, fw], 0)
    grid = g.concat([g.unsqueeze(g.op("Expand", g.unsqueeze(gx, [0]), hw), [2]),
                     g.unsqueeze(g.op("Expand", g.unsqueeze(gy, [1]), hw), [2])], 2)  # [H, W, 2] (x, y)
    out = g.op("GridSample", m, g.unsqueeze(grid, [0]), mode="bilinear", padding_mode="border", align_corners=0)
    mask = g.reshape(out, g.concat([fh, fw], 0))
    if p["threshold"] > 0:
        g.output(g.cast(g.op("GreaterOrEqual", mask, g.const(p["threshold"], FLOAT)), UINT8), "mask", UINT8,
                 ["frame_height", "frame_width"])
    else:
        g.output(mask, "mask", FLOAT, ["frame_height", "frame_width"])
    return g.model(f"{recipe}: " + ", ".join(f"{k}={v}" for k, v in sorted(p.items())))
