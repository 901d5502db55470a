"""How `bundle create` reads a model's dynamic dimensions into the manifest's tensor shapes."""

from __future__ import annotations

from onnx import TensorProto
from onnx import helper as oh

from agent.bundle.create import _dims


def test_a_dim_value_of_minus_one_is_a_dynamic_dim_not_a_size() -> None:
    # Paddle2ONNX exports (PP-OCR's direction classifier in rapidocr-onnxruntime) mark dynamic dims with
    # dim_value -1: copied as -1, the manifest failed its schema ("key input.shape[0]: -1 is not valid").
    vi = oh.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, "width", 0])
    assert _dims(vi) == ["batch", 3, "dim2", "width", "dim4"]
