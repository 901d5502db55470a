#!/usr/bin/env python3
"""The pre and post stages of the PP-OCR text-line recogniser (rapidocr's TextRecognizer), as ONNX graphs.

pre: a uint8 BGR line of any size -> x [1, 3, 48, PW]: the package's resize_norm_img for one line
(its batch of one): ratio = w / h; PW = int(48 * max(320 / 48, ratio)); the line resized to
(min(ceil(48 * ratio), PW), 48) with cv2.resize INTER_LINEAR, reproduced bit for bit by the recipes'
shared agent/bundle/graphs/resize_cv2.py (OpenCV's fixed-point bilinear: 11-bit coefficients rounded half to even, the row pass exact in integers,
the column pass as its vector code does it: ((S0 >> 4) * b0 >> 16) + ((S1 >> 4) * b1 >> 16) + 2 >> 2,
saturated to uint8; measured equal on every frame of the suite with opencv-python 5.0), then
(x / 255 - 0.5) / 0.5 in float32 and zeros padded on the right up to PW.
post: the `post.ctc` recipe (agent/bundle/graphs/post_ctc.py, `edge-agent bundle graph post.ctc`):
softmax [1, T, C] -> tokens, token_scores, greedy CTC as CTCLabelDecode (repeats collapsed, blank 0 dropped).

The vocabulary cannot state the pre stage (a width from the frame's own ratio, a ceiling capped by a
floor, padding to a data-dependent width); its resize is OpenCV's integer arithmetic because a float
bilinear resize differs by one level on about a tenth of the values, which flips a space at a line's
end on about one frame in twenty. No Python travels in a bundle: this script writes the graphs at build time.

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

from agent.bundle.graphs import resize_cv2
from agent.bundle.graphs.builder import DOUBLE, FLOAT, INT64, UINT8, Graph

OPSET = 18
HEIGHT = 48  # rec_img_shape [3, 48, 320] in the package's config.yaml
MIN_WIDTH = 320
MODEL_INPUT = "x"
MODEL_OUTPUT = "softmax_11.tmp_0"


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


def pre_graph(height: int = HEIGHT, min_width: int = MIN_WIDTH, input_name: str = MODEL_INPUT,
              fixed_width: int | None = None) -> onnx.ModelProto:
    """The recogniser's resize_norm_img; with `fixed_width` the direction classifier's (TextClassifier:
    width min(ceil(48 * ratio), fixed_width), padded to fixed_width). The resize is the recipes' shared
    cv2 INTER_LINEAR (agent/bundle/graphs/resize_cv2.py)."""
    g = Graph("ppocr_rec_pre")
    frame = g.input("frame", UINT8, ["H", "W", 3])
    shape = g.op("Shape", frame)
    h, w = g.gather(shape, [0]), g.gather(shape, [1])
    # widths in double, as Python computes them: w * 1.0 / h; int(48 * max(320 / 48, ratio)); ceil(48 * ratio)
    ratio = g.op("Div", g.cast(w, DOUBLE), g.cast(h, DOUBLE))
    h48 = g.const([float(height)], DOUBLE)
    if fixed_width is None:
        pad_w_f = g.op("Floor", g.op("Mul", h48, g.op("Max", g.const([min_width / height], DOUBLE), ratio)))
    else:
        pad_w_f = g.const([float(fixed_width)], DOUBLE)
    res_w_f = g.op("Min", g.op("Ceil", g.op("Mul", h48, ratio)), pad_w_f)
    pad_w, res_w = g.cast(pad_w_f, INT64), g.cast(res_w_f, INT64)
    pix = resize_cv2.linear(g, g.cast(frame, resize_cv2.INT32), h, w, g.const([height], INT64), res_w)
    # resized_image.astype(float32).transpose((2, 0, 1)) / 255; -= 0.5; /= 0.5
    x = g.op("Transpose", g.cast(pix, FLOAT), perm=[2, 0, 1])
    x = g.op("Div", x, g.const(255.0, FLOAT))
    half = g.const(0.5, FLOAT)
    x = g.unsqueeze(g.op("Div", g.op("Sub", x, half), half), [0])
    z = g.const([0], INT64)
    pads = g.concat([z, z, z, z, z, z, z, g.op("Sub", pad_w, res_w)], 0)
    x = g.op("Pad", x, pads, mode="constant")
    g.output(x, input_name, FLOAT, [1, 3, height, fixed_width or "PW"])
    return g.model("scripts/ppocr_rec_graphs.py: the PP-OCR line pre stage")


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
