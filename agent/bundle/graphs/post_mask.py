"""Saliency/probability map -> `mask` [H, W] at frame size (U2Net-style per-image min-max normalisation).

The map [1, C, h, w] (one channel used) is optionally sigmoided and min-max normalised per image
((d - min) / (max - min), U2Net's normPRED), then sampled bilinearly at each frame pixel's centre mapped
through `geometry` into the model input, separably (columns, then rows): a stretch is a plain half-pixel
resize, and a letterbox's pad is never part of the mask. threshold > 0 gives a uint8 0/1 mask; otherwise the
float map, for the masks kind's `postprocess.result.threshold`.
With resize pil the map is first quantised to 8-bit levels as a package's `(map * 255).astype(uint8)` does
(truncated), then resized straight to the frame size as PIL's Image.resize does it (a stretch: `geometry` is
not read), and the threshold is compared on the levels (level >= threshold * 255).
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs import resize_pil
from agent.bundle.graphs.builder import FLOAT, INT64, UINT8, Graph
from agent.bundle.graphs.params import Param, describe

PARAMS: dict[str, dict[str, Param]] = {
    "post.saliency": {
        "input": Param("str", "output", "the model output [1, C, h, w] holding the map"),
        "channel": Param("int", 0, "the channel of the map", minimum=0),
        "sigmoid": Param("bool", False, "the map is logits: sigmoid first"),
        "normalize": Param("str", "minmax", "per-image minmax ((d - min) / (max - min)) or none", ("minmax", "none")),
        "width": Param("int", 0, "model input width the map covers (0: the map's own width)", minimum=0),
        "height": Param("int", 0, "model input height (0: the map's own height)", minimum=0),
        "threshold": Param("float", 0.0, "> 0: output a uint8 mask, 1 where the map is at or over this"),
        "resize": Param("str", "bilinear", "to frame size: bilinear (through geometry, in float) or pil (the map "
                        "as 8-bit levels, truncated, then PIL Image.resize to the frame: a stretch)", ("bilinear", "pil")),
        "interpolation": Param("str", "lanczos", "PIL's filter with resize pil (BILINEAR/BICUBIC/LANCZOS)",
                               resize_pil.FILTERS),
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

    m2 = g.squeeze(m, [0, 1])  # [h, w]
    map_hw = g.op("Shape", m2)
    fh, fw = g.gather(frame_size, [0]), g.gather(frame_size, [1])
    if p["resize"] == "pil":
        levels = g.cast(g.op("Floor", g.op("Mul", m2, g.const(255.0, FLOAT))), resize_pil.INT32)
        sized = resize_pil.resize(g, g.unsqueeze(levels, [2]), g.gather(map_hw, [0]), g.gather(map_hw, [1]), fh, fw,
                                  p["interpolation"])
        level_map = g.cast(g.squeeze(sized, [2]), FLOAT)
        if p["threshold"] > 0:
            g.output(g.cast(g.op("GreaterOrEqual", level_map, g.const(p["threshold"] * 255.0, FLOAT)), UINT8), "mask",
                     UINT8, ["frame_height", "frame_width"])
        else:
            g.output(g.op("Div", level_map, g.const(255.0, FLOAT)), "mask", FLOAT, ["frame_height", "frame_width"])
        return g.model(f"{recipe}: {describe(p)}")
    y0, y1, fy = _taps(g, fh, geometry, 1, in_h, g.gather(map_hw, [0]))
    x0, x1, fx = _taps(g, fw, geometry, 0, in_w, g.gather(map_hw, [1]))
    # separable bilinear, both passes as row gathers (contiguous copies): columns on the small transposed map
    # ([W, h]), back to [h, W], then rows ([H, W]); a Gather along axis 1 is element by element, 10x slower
    mt = g.op("Transpose", m2, perm=[1, 0])
    c0, c1 = g.gather(mt, x0, axis=0), g.gather(mt, x1, axis=0)
    cols = g.op("Transpose", g.op("Add", c0, g.op("Mul", g.op("Sub", c1, c0), g.unsqueeze(fx, [1]))), perm=[1, 0])
    r0, r1 = g.gather(cols, y0, axis=0), g.gather(cols, y1, axis=0)
    mask = g.op("Add", r0, g.op("Mul", g.op("Sub", r1, r0), g.unsqueeze(fy, [1])))
    if p["threshold"] > 0:
        g.output(g.cast(g.op("GreaterOrEqual", mask, g.const(p["threshold"], FLOAT)), UINT8), "mask", UINT8,
                 ["frame_height", "frame_width"])
    else:
        g.output(mask, "mask", FLOAT, ["frame_height", "frame_width"])
    return g.model(f"{recipe}: {describe(p)}")


def _taps(g: Graph, n: str, geometry: str, axis: int, size_in: str, size_map: str) -> tuple[str, str, str]:
    """For the n frame pixel centres along one axis: the two map indices either side and the weight of the second.

    Frame centre (i + 0.5) -> input (i + 0.5) * scale - crop + pad -> map u = input * map / in - 0.5, clamped
    to the map (edge pixels repeat, as cv2's and a half-pixel resize's borders do)."""
    centres = g.op("Add", g.cast(g.op("Range", g.const(0, INT64), g.squeeze(n, [0]), g.const(1, INT64)), FLOAT),
                   g.const(0.5, FLOAT))
    at = g.op("Add", g.op("Mul", centres, g.gather(geometry, [axis])),
              g.op("Sub", g.gather(geometry, [2 + axis]), g.gather(geometry, [4 + axis])))
    size_map_f = g.cast(size_map, FLOAT)
    u = g.op("Sub", g.op("Div", g.op("Mul", at, size_map_f), size_in), g.const(0.5, FLOAT))
    u = g.op("Max", g.op("Min", u, g.op("Sub", size_map_f, g.const(1.0, FLOAT))), g.const(0.0, FLOAT))
    lo = g.op("Floor", u)
    i0 = g.cast(lo, INT64)
    i1 = g.op("Min", g.op("Add", i0, g.const(1, INT64)), g.op("Sub", size_map, g.const(1, INT64)))
    return i0, i1, g.op("Sub", u, lo)
