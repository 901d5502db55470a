"""Image pre graphs: a uint8 frame [H, W, 3] of any size -> the model's input tensor and `geometry` [6].

One family, six geometries (stretch, letterbox, stretch_crop, short_side_crop, native, fit_multiple), then one
shared tail: colour order, normalisation (scale, per-image max or min-max, mean/std), layout and dtype. Size
arithmetic runs in float64 so `floor`/`round` land exactly where Python's int()/round() land for the same frame.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs import resize_cv2, resize_pil
from agent.bundle.graphs.builder import DOUBLE, FLOAT, FLOAT16, INT64, UINT8, Graph
from agent.bundle.graphs.params import Param, describe
from agent.errors import UsageError

_INTERPOLATION: dict[str, dict[str, Any]] = {  # cv2 INTER_* -> ONNX Resize
    "linear": {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    "cubic": {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75},
    "nearest": {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
}

COMMON: dict[str, Param] = {
    "input_name": Param("str", "images", "the model input this graph feeds (its output name)"),
    "frame_color": Param("str", "rgb", "channel order of the frames the agent delivers (frame.color)", ("rgb", "bgr")),
    "color": Param("str", "rgb", "channel order the model takes", ("rgb", "bgr")),
    "interpolation": Param("str", "linear", "resize filter, as cv2 INTER_LINEAR/CUBIC/NEAREST (or, with resize pil, "
                           "PIL's BILINEAR/BICUBIC/LANCZOS)", (*_INTERPOLATION, "lanczos")),
    "resize": Param("str", "float", "resize arithmetic: float (onnxruntime Resize, then round_resize), cv2_exact "
                    "(cv2.resize INTER_LINEAR of a uint8 frame bit for bit, OpenCV's 11-bit fixed point) or pil "
                    "(PIL Image.resize of the uint8 frame: antialiased when shrinking, two rounded passes)",
                    ("float", "cv2_exact", "pil")),
    "round_resize": Param("bool", True, "round the resized image to whole levels (halves up), as a uint8 cv2.resize does"),
    "normalize": Param("str", "none", "per-image normalisation before mean/std: none (x * scale), "
                       "max (x / max(x)) or minmax ((x - min) / (max - min))", ("none", "max", "minmax")),
    "scale": Param("float", 1.0, "multiplier on pixel values when normalize is none (1/255: 0.00392156862745098)"),
    "mean": Param("floats", (), "per-channel mean subtracted after scaling (model channel order)"),
    "std": Param("floats", (), "per-channel std divided by after the mean"),
    "layout": Param("str", "nchw", "model input layout (batch axis 1 first)", ("nchw", "nhwc")),
    "dtype": Param("str", "float32", "model input dtype", ("float32", "float16", "uint8")),
}

SIZE = {"width": Param("int", 640, "model input width"), "height": Param("int", 640, "model input height")}
CROP = {"width": Param("int", 224, "crop (model input) width"), "height": Param("int", 224, "crop (model input) height")}
PAD = {"pad_value": Param("int", 114, "value of padded pixels (0-255, before normalisation)")}

PARAMS: dict[str, dict[str, Param]] = {
    "pre.stretch": {**SIZE, **COMMON},
    "pre.letterbox": {**SIZE, **PAD, **COMMON,
                      "rounding": Param("str", "round", "resized size: round (Ultralytics, round(w * s)) or floor "
                                        "(YOLOX and other int()-truncating packages, int(w * s))", ("round", "floor")),
                      "anchor": Param("str", "center", "where the image sits: center (pad split, the smaller half "
                                      "left/top) or top_left (all padding right/bottom, YOLOX)", ("center", "top_left"))},
    "pre.stretch_crop": {**CROP, **COMMON,
                         "resize_width": Param("int", 256, "stretch to this width first"),
                         "resize_height": Param("int", 256, "stretch to this height first"),
                         "crop_offset": Param("str", "round", "centre-crop offset: round (torchvision CenterCrop, "
                                              "int(round(d / 2))) or floor (d // 2)", ("round", "floor"))},
    "pre.short_side_crop": {**CROP, **COMMON,
                            "short_side": Param("int", 256, "the short side becomes this"),
                            "size_rounding": Param("str", "floor", "long side: floor (torchvision Resize(int), "
                                                   "int(S * long / short)) or round (PaddleClas)", ("floor", "round")),
                            "crop_offset": Param("str", "round", "centre-crop offset: round (torchvision) or floor "
                                                 "(PaddleClas)", ("round", "floor"))},
    "pre.native": {**PAD, **COMMON,
                   "multiple": Param("int", 32, "pad right/bottom to a multiple of this (1: the frame as it is)")},
    "pre.fit_multiple": {**COMMON,
                         "limit_side": Param("int", 960, "the side limit (PaddleOCR limit_side_len)"),
                         "limit_type": Param("str", "max", "max: shrink so the long side is at most limit_side; min: "
                                             "grow so the short side is at least limit_side", ("max", "min")),
                         "multiple": Param("int", 32, "each side rounded to a multiple of this (at least one)")},
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    if p["resize"] == "cv2_exact" and p["interpolation"] != "linear":
        raise UsageError(f"recipe {recipe}: --param resize: cv2_exact is the linear resize, found interpolation "
                         f"{p['interpolation']}")
    pil_needed = p["interpolation"] == "lanczos"
    if p["resize"] == "pil" and p["interpolation"] not in resize_pil.FILTERS or pil_needed and p["resize"] != "pil":
        raise UsageError(f"recipe {recipe}: --param interpolation {p['interpolation']} with resize {p['resize']}: "
                         f"resize pil takes {'/'.join(resize_pil.FILTERS)}; lanczos needs resize pil")
    g = Graph(recipe.replace(".", "_"))
    frame = g.input("frame", UINT8, ["frame_height", "frame_width", 3])
    shape = g.op("Shape", frame)
    h64, w64 = g.gather(shape, [0]), g.gather(shape, [1])  # int64 [1]
    h, w = g.cast(h64, DOUBLE), g.cast(w64, DOUBLE)

    # [1, H, W, 3] float levels: resized in NHWC (onnxruntime's NHWC linear path), transposed once it is small
    x = g.unsqueeze(g.cast(frame, FLOAT), [0])

    sx = sy = pad_x = pad_y = crop_x = crop_y = ""  # "" : the identity (1 for scales, 0 for offsets)
    kind = recipe.split(".", 1)[1]
    if kind == "native":
        m = p["multiple"]
        if m < 1:
            raise UsageError(f"recipe {recipe}: --param multiple: expected an integer >= 1, found {m}")
        mc = g.const([m], INT64)
        up_h = g.op("Mul", g.op("Div", g.op("Add", h64, g.const([m - 1], INT64)), mc), mc)
        up_w = g.op("Mul", g.op("Div", g.op("Add", w64, g.const([m - 1], INT64)), mc), mc)
        image = x
        if m > 1:
            x = _pad(g, x, g.const([0], INT64), g.const([0], INT64), g.op("Sub", up_h, h64), g.op("Sub", up_w, w64),
                     p["pad_value"])
        out_hw: list[Any] = ["input_height", "input_width"]
    elif kind == "fit_multiple":
        # PaddleOCR DetResizeForTest (resize_image_type0): ratio from the limit, int(h * ratio), then
        # max(int(round(v / multiple) * multiple), multiple); Round is half-to-even like Python's round()
        limit, m = float(p["limit_side"]), p["multiple"]
        if m < 1 or limit < 1:
            raise UsageError(f"recipe {recipe}: --param limit_side/multiple: expected integers >= 1, found "
                             f"{p['limit_side']}/{m}")
        one, lim = g.const([1.0], DOUBLE), g.const([limit], DOUBLE)
        if p["limit_type"] == "max":
            side, beyond = g.op("Max", h, w), "Greater"
        else:
            side, beyond = g.op("Min", h, w), "Less"
        ratio = g.op("Where", g.op(beyond, side, lim), g.op("Div", lim, side), one)
        mult = g.const([float(m)], DOUBLE)
        sized = []
        for v in (h, w):
            v = g.op("Floor", g.op("Mul", v, ratio))
            v = g.op("Max", g.op("Mul", g.op("Round", g.op("Div", v, mult)), mult), mult)
            sized.append(g.cast(v, INT64))
        new_h, new_w = sized
        x = image = _resize(g, x, new_h, new_w, p)
        sx, sy = g.op("Div", g.cast(new_w, DOUBLE), w), g.op("Div", g.cast(new_h, DOUBLE), h)
        out_hw = ["input_height", "input_width"]
    else:
        th, tw = p["height"], p["width"]
        if th < 1 or tw < 1:
            raise UsageError(f"recipe {recipe}: --param width/height: expected sizes >= 1, found {tw}x{th}")
        out_hw = [th, tw]
        if kind == "stretch":
            x = image = _resize(g, x, g.const([th], INT64), g.const([tw], INT64), p)
            sx, sy = g.op("Div", g.const([float(tw)], DOUBLE), w), g.op("Div", g.const([float(th)], DOUBLE), h)
        elif kind == "letterbox":
            s = g.op("Min", g.op("Div", g.const([float(tw)], DOUBLE), w), g.op("Div", g.const([float(th)], DOUBLE), h))
            rnd = "Round" if p["rounding"] == "round" else "Floor"
            new_w = _at_least_one(g, g.cast(g.op(rnd, g.op("Mul", w, s)), INT64))
            new_h = _at_least_one(g, g.cast(g.op(rnd, g.op("Mul", h, s)), INT64))
            x = _resize(g, x, new_h, new_w, p)
            extra_w, extra_h = g.op("Sub", g.const([tw], INT64), new_w), g.op("Sub", g.const([th], INT64), new_h)
            if p["anchor"] == "center":
                two = g.const([2], INT64)
                left, top = g.op("Div", extra_w, two), g.op("Div", extra_h, two)
            else:
                left = top = g.const([0], INT64)
            image = x
            x = _pad(g, x, top, left, g.op("Sub", extra_h, top), g.op("Sub", extra_w, left), p["pad_value"])
            sx = sy = s
            pad_x, pad_y = g.cast(left, DOUBLE), g.cast(top, DOUBLE)
        elif kind == "stretch_crop":
            rw, rh = p["resize_width"], p["resize_height"]
            if rw < tw or rh < th:
                raise UsageError(f"recipe {recipe}: the crop {tw}x{th} is larger than the resize {rw}x{rh}")
            x = _resize(g, x, g.const([rh], INT64), g.const([rw], INT64), p)
            cx, cy = (int(round((rw - tw) / 2.0)), int(round((rh - th) / 2.0))) if p["crop_offset"] == "round" \
                else ((rw - tw) // 2, (rh - th) // 2)
            x = image = g.slice(x, [cy, cx], [cy + th, cx + tw], [1, 2])
            sx, sy = g.op("Div", g.const([float(rw)], DOUBLE), w), g.op("Div", g.const([float(rh)], DOUBLE), h)
            crop_x, crop_y = g.const([float(cx)], DOUBLE), g.const([float(cy)], DOUBLE)
        elif kind == "short_side_crop":
            side = p["short_side"]
            if side < max(tw, th):
                raise UsageError(f"recipe {recipe}: short_side {side} is smaller than the crop {tw}x{th}")
            portrait = g.op("LessOrEqual", w, h)
            long_, short = g.op("Where", portrait, h, w), g.op("Where", portrait, w, h)
            rnd = "Round" if p["size_rounding"] == "round" else "Floor"
            new_long = g.cast(g.op(rnd, g.op("Div", g.op("Mul", g.const([float(side)], DOUBLE), long_), short)), INT64)
            side_c = g.const([side], INT64)
            new_w, new_h = g.op("Where", portrait, side_c, new_long), g.op("Where", portrait, new_long, side_c)
            x = _resize(g, x, new_h, new_w, p)
            dx, dy = g.op("Sub", new_w, g.const([tw], INT64)), g.op("Sub", new_h, g.const([th], INT64))
            if p["crop_offset"] == "round":
                half = g.const([2.0], DOUBLE)
                cx64 = g.cast(g.op("Round", g.op("Div", g.cast(dx, DOUBLE), half)), INT64)
                cy64 = g.cast(g.op("Round", g.op("Div", g.cast(dy, DOUBLE), half)), INT64)
            else:
                two = g.const([2], INT64)
                cx64, cy64 = g.op("Div", dx, two), g.op("Div", dy, two)
            starts = g.concat([cy64, cx64], 0)
            ends = g.op("Add", starts, g.const([th, tw], INT64))
            x = image = g.slice(x, starts, ends, [1, 2])
            sx, sy = g.op("Div", g.cast(new_w, DOUBLE), w), g.op("Div", g.cast(new_h, DOUBLE), h)
            crop_x, crop_y = g.cast(cx64, DOUBLE), g.cast(cy64, DOUBLE)
        else:  # pragma: no cover - PARAMS names the recipes
            raise AssertionError(recipe)

    if p["frame_color"] != p["color"]:
        x = g.gather(x, [2, 1, 0], axis=3)
    x = _normalise(g, x, image, p, recipe)
    if p["layout"] == "nchw":
        x = g.op("Transpose", x, perm=[0, 3, 1, 2])
        shape_out: list[Any] = [1, 3, *out_hw]
    else:
        shape_out = [1, *out_hw, 3]
    dtype = {"float32": FLOAT, "float16": FLOAT16, "uint8": UINT8}[p["dtype"]]
    if dtype == UINT8:
        x = g.op("Clip", g.op("Round", x), g.const(0.0, FLOAT), g.const(255.0, FLOAT))
    if dtype != FLOAT:
        x = g.cast(x, dtype)
    g.output(x, p["input_name"], dtype, shape_out)
    parts = [v or g.const([1.0 if i < 2 else 0.0], DOUBLE) for i, v in enumerate((sx, sy, pad_x, pad_y, crop_x, crop_y))]
    geometry = g.cast(g.concat(parts, 0), FLOAT)
    g.output(geometry, "geometry", FLOAT, [6])
    return g.model(f"{recipe}: {describe(p)}")


def _at_least_one(g: Graph, v: str) -> str:
    return g.op("Max", v, g.const([1], INT64))


def _resize(g: Graph, x: str, new_h: str, new_w: str, p: dict[str, Any]) -> str:
    if p["resize"] == "pil":
        shape = g.op("Shape", x)
        src = g.cast(g.squeeze(x, [0]), resize_pil.INT32)
        y = resize_pil.resize(g, src, g.gather(shape, [1]), g.gather(shape, [2]), new_h, new_w, p["interpolation"])
        return g.unsqueeze(g.cast(y, FLOAT), [0])
    if p["resize"] == "cv2_exact":
        # x holds whole levels (the uint8 frame, cast): exact in int64, and whole levels again after
        shape = g.op("Shape", x)
        src = g.cast(g.squeeze(x, [0]), resize_cv2.INT32)
        y = resize_cv2.linear(g, src, g.gather(shape, [1]), g.gather(shape, [2]), new_h, new_w)
        return g.unsqueeze(g.cast(y, FLOAT), [0])
    empty = g.const([], FLOAT)
    if p["interpolation"] == "cubic":
        # onnxruntime refuses a cubic NHWC shrink, and its transpose optimiser turns an NCHW detour back into
        # one: each channel is resized as a 2-D image (its 'Bicubic' case)
        sizes = g.concat([new_h, new_w], 0)
        planes = [g.op("Resize", g.gather(g.squeeze(x, [0]), c, axis=2), "", empty, sizes, **_INTERPOLATION["cubic"])
                  for c in range(3)]
        y = g.unsqueeze(g.op("Concat", *[g.unsqueeze(q, [2]) for q in planes], axis=2), [0])
    else:
        sizes = g.concat([g.const([1], INT64), new_h, new_w, g.const([3], INT64)], 0)
        y = g.op("Resize", x, "", empty, sizes, **_INTERPOLATION[p["interpolation"]])
    if p["round_resize"]:
        # a uint8 cv2.resize stores whole levels, halves rounded up: floor(v + 0.5) equals it bit for bit at
        # exact 2x, elsewhere cv2's 11-bit fixed-point weights differ by one level on about 13 % of values
        # (onnxruntime's own uint8 Resize truncates: one level off on half of them)
        y = g.op("Clip", g.op("Floor", g.op("Add", y, g.const(0.5, FLOAT))), g.const(0.0, FLOAT), g.const(255.0, FLOAT))
    return y


def _pad(g: Graph, x: str, top: str, left: str, bottom: str, right: str, value: int) -> str:
    zero = g.const([0], INT64)
    pads = g.concat([zero, top, left, zero, zero, bottom, right, zero], 0)
    return g.op("Pad", x, pads, g.const(float(value), FLOAT), mode="constant")


def _normalise(g: Graph, x: str, image: str, p: dict[str, Any], recipe: str) -> str:
    """x * scale, or x over the per-image max or min-max of `image` (x before padding: statistics cover the
    frame's content, never the pad), then (x - mean) / std."""
    if p["normalize"] == "max":
        x = g.op("Div", x, g.op("Max", g.op("ReduceMax", image, keepdims=0), g.const(1e-12, FLOAT)))
    elif p["normalize"] == "minmax":
        lo, hi = g.op("ReduceMin", image, keepdims=0), g.op("ReduceMax", image, keepdims=0)
        x = g.op("Div", g.op("Sub", x, lo), g.op("Max", g.op("Sub", hi, lo), g.const(1e-12, FLOAT)))
    elif p["scale"] != 1.0:
        x = g.op("Mul", x, g.const(p["scale"], FLOAT))
    for key in ("mean", "std"):
        if p[key] and len(p[key]) not in (1, 3):
            raise UsageError(f"recipe {recipe}: --param {key}: expected 1 or 3 numbers, found {len(p[key])}")
    if p["mean"]:
        x = g.op("Sub", x, g.const(_per_channel(p["mean"]), FLOAT))
    if p["std"]:
        if any(s == 0 for s in p["std"]):
            raise UsageError(f"recipe {recipe}: --param std: a std of 0")
        x = g.op("Div", x, g.const(_per_channel(p["std"]), FLOAT))
    return x


def _per_channel(values: tuple[float, ...]) -> list[list[list[list[float]]]]:
    """Per-channel constants shaped [1, 1, 1, 3], for the NHWC image."""
    vals = list(values) * 3 if len(values) == 1 else list(values)
    return [[[vals]]]
