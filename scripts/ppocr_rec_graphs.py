#!/usr/bin/env python3
"""The pre and post stages of the PP-OCR text-line recogniser (rapidocr's TextRecognizer), as ONNX graphs.

pre: a uint8 BGR line of any size -> x [1, 3, 48, PW]: the package's resize_norm_img for one line
(its batch of one): ratio = w / h; PW = int(48 * max(320 / 48, ratio)); the line resized to
(min(ceil(48 * ratio), PW), 48) with cv2.resize INTER_LINEAR, reproduced bit for bit (OpenCV's
fixed-point bilinear: 11-bit coefficients rounded half to even, the row pass exact in integers,
the column pass as its vector code does it: ((S0 >> 4) * b0 >> 16) + ((S1 >> 4) * b1 >> 16) + 2 >> 2,
saturated to uint8; measured equal on every frame of the suite with opencv-python 5.0), then
(x / 255 - 0.5) / 0.5 in float32 and zeros padded on the right up to PW.
post: the `post.ctc` recipe (agent/bundle/graphs/post_ctc.py, `edge-agent bundle graph post.ctc`):
softmax [1, T, C] -> tokens, token_scores, greedy CTC as CTCLabelDecode (repeats collapsed, blank 0 dropped).

The vocabulary cannot state the pre stage (a width from the frame's own ratio, a ceiling capped by a
floor, padding to a data-dependent width, and OpenCV's integer arithmetic): a float bilinear resize
differs by one level on about a tenth of the values, which flips a space at a line's end on about
one frame in twenty. No Python travels in a bundle: this script writes the graphs at build time.

The direction classifier (TextClassifier) shares the pre stage with a fixed width of 192 (its lines are
resized to min(ceil(48 * ratio), 192) and padded to 192); its post stage keeps P('180'), the one score
its decision reads (it turns a line when that is over cls_thresh 0.9).

  python scripts/ppocr_rec_graphs.py --out DIR   # DIR/pre.onnx, post.onnx (recogniser), cls_pre.onnx, cls_post.onnx
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as oh
from onnx import numpy_helper as nh

OPSET = 18
HEIGHT = 48  # rec_img_shape [3, 48, 320] in the package's config.yaml
MIN_WIDTH = 320
MODEL_INPUT = "x"
MODEL_OUTPUT = "softmax_11.tmp_0"
COEF_BITS = 11  # OpenCV INTER_RESIZE_COEF_BITS


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0

    def const(self, value: Any, dtype: Any) -> str:
        self._n += 1
        name = f"c{self._n}"
        self.inits.append(nh.from_array(np.asarray(value, dtype), name))
        return name

    def used_initializers(self) -> list[Any]:
        names = {i for n in self.nodes for i in n.input}
        return [t for t in self.inits if t.name in names]

    def op(self, op: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        self._n += 1
        name = out or f"t{self._n}_{op.lower()}"
        self.nodes.append(oh.make_node(op, list(inputs), [name], **attrs))
        return name


def _coefficients(g: _Graph, src: str, dst: str, clamp: bool) -> tuple[str, str, str]:
    """cv::resize's source index and fixed-point weights for each destination index along one axis.
    src, dst: int64 [1] sizes. Returns (index int64 [dst], weight0 int64 [dst], weight1 int64 [dst])."""
    src_d = g.op("Cast", src, to=T.DOUBLE)
    dst_d = g.op("Cast", dst, to=T.DOUBLE)
    scale = g.op("Div", g.const([1.0], np.float64), g.op("Div", dst_d, src_d))  # 1. / inv_scale, in double
    dst_scalar = g.op("Squeeze", dst, g.const([0], np.int64))
    d = g.op("Cast", g.op("Range", g.const(0, np.int64), dst_scalar, g.const(1, np.int64)), to=T.DOUBLE)
    # fx = (float)((dx + 0.5) * scale_x - 0.5); sx = cvFloor(fx); fx -= sx
    f = g.op("Cast", g.op("Sub", g.op("Mul", g.op("Add", d, g.const(0.5, np.float64)), scale),
                           g.const(0.5, np.float64)), to=T.FLOAT)
    s = g.op("Floor", f)
    frac = g.op("Sub", f, s)
    idx = g.op("Cast", s, to=T.INT64)
    zero_f = g.const(0.0, np.float32)
    if clamp:  # the column pass: sx < 0 -> (0, fx 0); sx >= W - 1 -> (W - 1, fx 0)
        last = g.op("Sub", src, g.const([1], np.int64))
        left = g.op("Less", idx, g.const(0, np.int64))
        frac = g.op("Where", left, zero_f, frac)
        idx = g.op("Where", left, g.const(0, np.int64), idx)
        right = g.op("GreaterOrEqual", idx, last)
        frac = g.op("Where", right, zero_f, frac)
        idx = g.op("Where", right, last, idx)
    one = g.const(1.0, np.float32)
    coef = g.const(float(1 << COEF_BITS), np.float32)
    # saturate_cast<short>(c * INTER_RESIZE_COEF_SCALE): round half to even, as ONNX Round
    w0 = g.op("Cast", g.op("Round", g.op("Mul", g.op("Sub", one, frac), coef)), to=T.INT64)
    w1 = g.op("Cast", g.op("Round", g.op("Mul", frac, coef)), to=T.INT64)
    return idx, w0, w1


def pre_graph(height: int = HEIGHT, min_width: int = MIN_WIDTH, input_name: str = MODEL_INPUT,
              fixed_width: int | None = None) -> onnx.ModelProto:
    """The recogniser's resize_norm_img; with `fixed_width` the direction classifier's (TextClassifier:
    width min(ceil(48 * ratio), fixed_width), padded to fixed_width)."""
    g = _Graph()
    shape = g.op("Shape", "frame")
    i0, i1, i2 = (g.const([k], np.int64) for k in range(3))
    h = g.op("Slice", shape, i0, i1)
    w = g.op("Slice", shape, i1, i2)
    out_h = g.const([height], np.int64)
    # widths in double, as Python computes them: w * 1.0 / h; int(48 * max(320 / 48, ratio)); ceil(48 * ratio)
    ratio = g.op("Div", g.op("Cast", w, to=T.DOUBLE), g.op("Cast", h, to=T.DOUBLE))
    h48 = g.const([float(height)], np.float64)
    if fixed_width is None:
        pad_w_f = g.op("Floor", g.op("Mul", h48, g.op("Max", g.const([min_width / height], np.float64), ratio)))
    else:
        pad_w_f = g.const([float(fixed_width)], np.float64)
    res_w_f = g.op("Min", g.op("Ceil", g.op("Mul", h48, ratio)), pad_w_f)
    pad_w = g.op("Cast", pad_w_f, to=T.INT64)
    res_w = g.op("Cast", res_w_f, to=T.INT64)

    # row pass (exact in integers): D[y, dx, c] = S[y, sx, c] * a0 + S[y, sx + 1, c] * a1
    sx, a0, a1 = _coefficients(g, w, res_w, clamp=True)
    sx1 = g.op("Min", g.op("Add", sx, g.const(1, np.int64)), g.op("Sub", w, i1))
    src = g.op("Cast", "frame", to=T.INT64)
    axes02 = g.const([0, 2], np.int64)
    rows = g.op("Add", g.op("Mul", g.op("Gather", src, sx, axis=1), g.op("Unsqueeze", a0, axes02)),
                g.op("Mul", g.op("Gather", src, sx1, axis=1), g.op("Unsqueeze", a1, axes02)))
    # column pass: source rows clipped to the frame, weights from the unclipped position
    sy, b0, b1 = _coefficients(g, h, out_h, clamp=False)
    zero = g.const(0, np.int64)
    last_row = g.op("Squeeze", g.op("Sub", h, i1), i0)
    y0 = g.op("Clip", sy, zero, last_row)
    y1 = g.op("Clip", g.op("Add", sy, g.const(1, np.int64)), zero, last_row)
    axes12 = g.const([1, 2], np.int64)
    k16, k65536, k4, k2 = (g.const(v, np.int64) for v in (16, 65536, 4, 2))  # all terms are >= 0: Div floors

    def term(r: str, b: str) -> str:
        return g.op("Div", g.op("Mul", g.op("Div", g.op("Gather", rows, r, axis=0), k16), g.op("Unsqueeze", b, axes12)), k65536)

    pix = g.op("Div", g.op("Add", g.op("Add", term(y0, b0), term(y1, b1)), k2), k4)
    pix = g.op("Clip", pix, zero, g.const(255, np.int64))
    # resized_image.astype(float32).transpose((2, 0, 1)) / 255; -= 0.5; /= 0.5
    x = g.op("Cast", pix, to=T.FLOAT)
    x = g.op("Transpose", x, perm=[2, 0, 1])
    x = g.op("Div", x, g.const(255.0, np.float32))
    half = g.const(0.5, np.float32)
    x = g.op("Div", g.op("Sub", x, half), half)
    x = g.op("Unsqueeze", x, i0)
    z = g.const([0], np.int64)
    pads = g.op("Concat", z, z, z, z, z, z, z, g.op("Sub", pad_w, res_w), axis=0)
    g.op("Pad", x, pads, out=input_name, mode="constant")
    graph = oh.make_graph(g.nodes, "ppocr_rec_pre", [oh.make_tensor_value_info("frame", T.UINT8, ["H", "W", 3])],
                          [oh.make_tensor_value_info(input_name, T.FLOAT, [1, 3, height, fixed_width or "PW"])],
                          g.used_initializers())
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)], producer_name="scripts/ppocr_rec_graphs.py")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


CLS_OUTPUT = "save_infer_model/scale_0.tmp_1"
CLS_WIDTH = 192  # cls_image_shape [3, 48, 192]


def cls_post_graph(output: str = CLS_OUTPUT, channel: int = 1) -> onnx.ModelProto:
    """softmax [1, 2] (labels '0', '180') -> scores [1]: P('180'), the one score the package decides on."""
    g = _Graph()
    g.op("Reshape", g.op("Slice", output, g.const([channel], np.int64), g.const([channel + 1], np.int64),
                         g.const([1], np.int64)), g.const([1], np.int64), out="scores")
    graph = oh.make_graph(g.nodes, "cls_180_score", [oh.make_tensor_value_info(output, T.FLOAT, [1, 2])],
                          [oh.make_tensor_value_info("scores", T.FLOAT, [1])], g.used_initializers())
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)], producer_name="scripts/ppocr_rec_graphs.py")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    onnx.save(pre_graph(), str(args.out / "pre.onnx"))
    from agent.bundle.graphs import build_graph

    onnx.save(build_graph("post.ctc", {"input": MODEL_OUTPUT}), str(args.out / "post.onnx"))
    onnx.save(pre_graph(fixed_width=CLS_WIDTH), str(args.out / "cls_pre.onnx"))
    onnx.save(cls_post_graph(), str(args.out / "cls_post.onnx"))
    print(" ".join(str(args.out / f) for f in ("pre.onnx", "post.onnx", "cls_pre.onnx", "cls_post.onnx")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
