"""How `bundle create` reads a model's dynamic dimensions into the manifest's tensor shapes."""

from __future__ import annotations

from onnx import TensorProto
from onnx import helper as oh

from agent.bundle.build_runs import _dims


def test_a_dim_value_of_minus_one_is_a_dynamic_dim_not_a_size() -> None:
    # Paddle2ONNX exports (PP-OCR's direction classifier in rapidocr-onnxruntime) mark dynamic dims with
    # dim_value -1: copied as -1, the manifest failed its schema ("key input.shape[0]: -1 is not valid").
    vi = oh.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, "width", 0])
    assert _dims(vi) == ["batch", 3, "dim2", "width", "dim4"]


def test_a_variant_whose_symbolic_dims_ort_names_otherwise_records_no_contract_of_its_own() -> None:
    # PP-OCRv4's recogniser quantised: ORT names its output dims 'p2o.DynamicDimension.0' and
    # 'floor(floor(floor(p2o.DynamicDimension.1/2 - 1/2)/2)/2 - 1/2) + 1' where FP32's manifest says
    # ["batch", "dim1", 6625]: recorded as the variant's own outputs, they failed the manifest schema.
    from pathlib import Path
    from types import SimpleNamespace

    from agent.bundle.build_runs import variant_outputs

    def session(*shape: object) -> SimpleNamespace:
        out = SimpleNamespace(name="softmax", type="tensor(float)", shape=list(shape))
        return SimpleNamespace(get_outputs=lambda: [out])

    fp32 = [{"name": "softmax", "dtype": "float32", "shape": ["batch", "dim1", 6625]}]
    odd = session("p2o.DynamicDimension.0", "floor(floor(p2o.DynamicDimension.1/2 - 1/2)/2) + 1", 6625)
    assert variant_outputs(odd, fp32, "int8", Path("m.onnx")) is None
    # a size quantisation really changed is still recorded, under a name the schema accepts
    fixed = variant_outputs(session("p2o.DynamicDimension.0", 40, 6625), fp32, "int8", Path("m.onnx"))
    assert fixed == [{"name": "softmax", "dtype": "float32", "shape": ["batch", 40, 6625]}]
    concrete = [{"name": "softmax", "dtype": "float32", "shape": [1, 40, 6625]}]
    assert variant_outputs(session(1, "floor(W/2) + 1", 6625), concrete, "int8", Path("m.onnx")) == [
        {"name": "softmax", "dtype": "float32", "shape": [1, "dim1", 6625]}]
