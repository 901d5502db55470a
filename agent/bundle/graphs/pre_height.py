"""pre.fit_height: a text-line or captcha pre graph. The frame resized to a fixed height, its width following the
aspect (`int(W * (height / H))`, as Python computes it), optionally turned to one luma channel, scaled.

What OCR packages do with PIL (ddddocr: `image.resize((int(W * (64 / H)), 64), LANCZOS)`, then `convert('L')`,
`/ 255`, `[1, 1, 64, W']`): the width is data-dependent, so frames are never batched together, and the model
input is `[1, C, height, input_width]`. The resize is `resize_pil` (Pillow's fixed-point passes, bit for bit
where its pass order is known: docs/recipes.md) or `resize_cv2` / float as in the other pre recipes. Grey is
Pillow's `convert('L')` of RGB: `(R * 19595 + G * 38470 + B * 7471 + 0x8000) >> 16`, in integers, so it is
exact; OpenCV's `cvtColor(RGB2GRAY)` (`gray: cv2`) as OpenCV 5.1 computes it, measured:
`(R * 9798 + G * 19235 + B * 3735 + 16384) >> 15`.
Geometry: `(W' / W, height / H, 0, 0, 0, 0)`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs import pre_image
from agent.bundle.graphs.builder import DOUBLE, FLOAT, FLOAT16, INT64, UINT8, Graph
from agent.bundle.graphs.params import Param, describe
from agent.errors import UsageError

INT32 = "int32"
# (weights, shift): luma in integers, as each library computes it from R, G, B
# cv2: OpenCV 5.1's cvtColor(RGB2GRAY) as measured (0 of 250,000 random pixels differ; its documented 14-bit
# weights 4899/9617/1868 differ on 673)
GRAY = {"pil": ((19595, 38470, 7471), 16), "cv2": ((9798, 19235, 3735), 15)}

PARAMS: dict[str, dict[str, Param]] = {
    "pre.fit_height": {
        "height": Param("int", 64, "model input height; the width follows the frame's aspect"),
        "width_rounding": Param("str", "floor", "the width: floor (Python's int(W * (height / H)), ddddocr) or round",
                                ("floor", "round")),
        "min_width": Param("int", 1, "the width is at least this"),
        "input_name": Param("str", "images", "the model input this graph feeds (its output name)"),
        "frame_color": Param("str", "rgb", "channel order of the frames the agent delivers (frame.color)",
                             ("rgb", "bgr")),
        "color": Param("str", "gray", "what the model takes: gray (one luma channel, as `gray` computes it), rgb "
                       "or bgr (three channels)", ("gray", "rgb", "bgr")),
        "gray": Param("str", "pil", "luma arithmetic: pil (Image.convert('L')) or cv2 (cvtColor RGB2GRAY)",
                      tuple(GRAY)),
        "interpolation": Param("str", "lanczos", "resize filter (PIL's LANCZOS/BICUBIC/BILINEAR with resize pil; "
                               "cv2's with float)", ("lanczos", "cubic", "linear", "nearest")),
        "resize": Param("str", "pil", "resize arithmetic: pil (PIL Image.resize of the uint8 frame), cv2_exact or "
                        "float (as the other pre recipes)", ("pil", "cv2_exact", "float")),
        "round_resize": Param("bool", True, "float resize only: round the resized image to whole levels"),
        "divide": Param("float", 255.0, "the levels divided by this (numpy's `x / 255.0` in float32: a multiply by "
                        "1/255 differs in the last bit)"),
        "scale": Param("float", 1.0, "then multiplied by this"),
        "mean": Param("floats", (), "subtracted after scaling (one value, or one per channel)"),
        "std": Param("floats", (), "divided by after the mean"),
        "dtype": Param("str", "float32", "model input dtype", ("float32", "float16", "uint8")),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    if p["height"] < 1 or p["min_width"] < 1:
        raise UsageError(f"recipe {recipe}: --param height/min_width: expected sizes >= 1, found "
                         f"{p['height']}/{p['min_width']}")
    if p["resize"] == "pil" and p["interpolation"] == "nearest":
        raise UsageError(f"recipe {recipe}: --param interpolation nearest with resize pil: pil takes lanczos, "
                         "cubic or linear")
    if p["resize"] == "cv2_exact" and p["interpolation"] != "linear":
        raise UsageError(f"recipe {recipe}: --param resize: cv2_exact is the linear resize, found interpolation "
                         f"{p['interpolation']}")
    if p["interpolation"] == "lanczos" and p["resize"] != "pil":
        raise UsageError(f"recipe {recipe}: --param interpolation lanczos needs resize pil")
    g = Graph(recipe.replace(".", "_"))
    frame = g.input("frame", UINT8, ["frame_height", "frame_width", 3])
    shape = g.op("Shape", frame)
    h64, w64 = g.gather(shape, [0]), g.gather(shape, [1])
    h, w = g.cast(h64, DOUBLE), g.cast(w64, DOUBLE)
    th = p["height"]
    # Python's int(W * (th / H)): the ratio first, then the product, in double
    width = g.op("Mul", w, g.op("Div", g.const([float(th)], DOUBLE), h))
    width = g.op("Floor" if p["width_rounding"] == "floor" else "Round", width)
    new_w = g.op("Max", g.cast(width, INT64), g.const([p["min_width"]], INT64))
    new_h = g.const([th], INT64)
    x = g.unsqueeze(g.cast(frame, FLOAT), [0])  # [1, H, W, 3] levels
    x = pre_image._resize(g, x, new_h, new_w, {**p, "interpolation": p["interpolation"]})  # [1, th, W', 3]
    if p["frame_color"] == "bgr":  # the arithmetic below reads R, G, B
        x = g.gather(x, [2, 1, 0], axis=3)
    if p["color"] == "gray":
        (wr, wg, wb), shift = GRAY[p["gray"]]
        levels = g.cast(x, INT32)  # whole levels after the resize
        acc = g.op("MatMul", levels, g.const([[wr], [wg], [wb]], INT32))  # [1, th, W', 1]
        acc = g.op("Add", acc, g.const(1 << (shift - 1), INT32))
        x = g.cast(g.op("Div", acc, g.const(1 << shift, INT32)), FLOAT)  # non-negative: Div is the shift
        channels = 1
    else:
        if p["color"] == "bgr":
            x = g.gather(x, [2, 1, 0], axis=3)
        channels = 3
    if p["divide"] == 0:
        raise UsageError(f"recipe {recipe}: --param divide: 0")
    if p["divide"] != 1.0:
        x = g.op("Div", x, g.const(p["divide"], FLOAT))
    if p["scale"] != 1.0:
        x = g.op("Mul", x, g.const(p["scale"], FLOAT))
    for key in ("mean", "std"):
        if p[key] and len(p[key]) not in (1, channels):
            raise UsageError(f"recipe {recipe}: --param {key}: expected 1 or {channels} numbers, found {len(p[key])}")
    if p["mean"]:
        x = g.op("Sub", x, g.const(list(p["mean"]), FLOAT))
    if p["std"]:
        if any(s == 0 for s in p["std"]):
            raise UsageError(f"recipe {recipe}: --param std: a std of 0")
        x = g.op("Div", x, g.const(list(p["std"]), FLOAT))
    x = g.op("Transpose", x, perm=[0, 3, 1, 2])  # [1, C, th, W']
    dtype = {"float32": FLOAT, "float16": FLOAT16, "uint8": UINT8}[p["dtype"]]
    if dtype == UINT8:
        x = g.op("Clip", g.op("Round", x), g.const(0.0, FLOAT), g.const(255.0, FLOAT))
    if dtype != FLOAT:
        x = g.cast(x, dtype)
    g.output(x, p["input_name"], dtype, [1, channels, th, "input_width"])
    sx = g.op("Div", g.cast(new_w, DOUBLE), w)
    sy = g.op("Div", g.const([float(th)], DOUBLE), h)
    zeros = g.const([0.0, 0.0, 0.0, 0.0], DOUBLE)
    g.output(g.cast(g.concat([sx, sy, zeros], 0), FLOAT), "geometry", FLOAT, [6])
    return g.model(f"{recipe}: {describe(p)}")
