"""Small pre and post ONNX graphs built with onnx.helper for the stage tests (the names of issue 21's interface:
pre input `frame`, outputs the model input and `geometry`; post inputs model outputs, `frame_size`, `geometry`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _save(nodes: list, inputs: list, outputs: list, path: Path, name: str) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def stretch_pre(path: Path, output: str, width: int, height: int, scale: float = 1.0,
                mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,), channels: int = 3) -> Path:
    """frame uint8 [H, W, C] (any size) -> NCHW float32 [1, C, height, width]: bilinear stretch (half-pixel
    centres, as OpenCV's INTER_LINEAR), rounded to uint8 values as OpenCV's uint8 resize does, then
    (x * scale - mean) / std per channel; `geometry` = [width / W, height / H, 0, 0, 0, 0]."""
    mul = (np.float32(scale) / np.asarray(std, np.float32)).reshape(1, -1, 1, 1).astype(np.float32)
    sub = (np.asarray(mean, np.float32) / np.asarray(std, np.float32)).reshape(1, -1, 1, 1).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["frame"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["chw"], perm=[2, 0, 1]),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["chw", "axes0"], ["nchw"]),
        _const("sizes", np.array([1, channels, height, width], np.int64)),
        helper.make_node("Resize", ["nchw", "", "", "sizes"], ["resized"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Round", ["resized"], ["rounded"]),
        _const("lo", np.array(0, np.float32)), _const("hi", np.array(255, np.float32)),
        helper.make_node("Clip", ["rounded", "lo", "hi"], ["pixels"]),
        _const("mul", mul), _const("sub", sub),
        helper.make_node("Mul", ["pixels", "mul"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "sub"], [output]),
        # geometry: scale_x = width / W, scale_y = height / H, no padding, no crop
        helper.make_node("Shape", ["frame"], ["shape"]),
        _const("hw_idx", np.array([1, 0], np.int64)),
        helper.make_node("Gather", ["shape", "hw_idx"], ["wh"]),
        helper.make_node("Cast", ["wh"], ["whf"], to=TensorProto.FLOAT),
        _const("target", np.array([width, height], np.float32)),
        helper.make_node("Div", ["target", "whf"], ["scales"]),
        _const("zeros", np.zeros(4, np.float32)),
        helper.make_node("Concat", ["scales", "zeros"], ["geometry"], axis=0),
    ]
    inputs = [helper.make_tensor_value_info("frame", TensorProto.UINT8, ["h", "w", channels])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, height, width]),
               helper.make_tensor_value_info("geometry", TensorProto.FLOAT, [6])]
    return _save(nodes, inputs, outputs, path, "stretch_pre")


def softmax_post(path: Path, logits: str, classes: int, output: str = "probabilities") -> Path:
    """logits [1, C] -> probabilities [C]."""
    nodes = [
        helper.make_node("Softmax", [logits], ["p"], axis=-1),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Squeeze", ["p", "axes0"], [output]),
    ]
    inputs = [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [1, classes])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [classes])]
    return _save(nodes, inputs, outputs, path, "softmax_post")
