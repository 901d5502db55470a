"""`bundle create` records each variant's contract from the ONNX Runtime view that serves it (issue 22).

A model whose graph declares an output dim symbolic ('n') that ONNX Runtime resolves (to 1) was refused
by its own build: the manifest recorded the graph's ['batch', 'n'], the device's contract check saw
['batch', 1]. And a decision on a channel beyond such a dim passed the spec check (the dim was a name)
and crashed the build with an IndexError.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.errors import BundleError


def _model(path: Path, out_shape: list) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    w = numpy_helper.from_array(np.full((8, 1), 0.25, np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _create(tmp: Path, model: Path, channel: int = 0, int8: bool = True) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    rng = np.random.default_rng(1)
    np.savez(tmp / "calib.npz", raw=rng.normal(0, 1, (16, 8, 1)).astype(np.float32))
    np.savez(tmp / "golden.npz", raw=rng.normal(0, 1, (4, 8, 1)).astype(np.float32))
    spec = {"name": "sym", "version": 1, "label": "0.1.0", "task": "raw",
            "frame": {"kind": "sensor", "window": 8, "channels": 1, "dtype": "float32"},
            "preprocess": {"layout": "nw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["y"], "max_values": 0,
                            "decision": {"rule": "threshold", "output": "y", "channel": channel, "threshold": 0.5}}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    return create_bundle(CreateOptions(model=model, spec=tmp / "spec.yaml", calibration=tmp / "calib.npz",
                                       golden=tmp / "golden.npz", out=tmp / "bundle", int8=int8,
                                       min_agreement=0.5, keep_low_quality=True))


@pytest.mark.parametrize("declared", [["batch", "n"], ["batch", None]])
def test_an_output_dim_the_graph_leaves_symbolic_and_ort_resolves_is_recorded_as_ort_serves_it(
        tmp_path: Path, declared: list) -> None:
    from agent.bundle.load import load_bundle

    bundle = _create(tmp_path, _model(tmp_path / "m.onnx", declared))
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    assert manifest["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 1]}]
    assert [v["name"] for v in manifest["variants"]] == ["fp32", "int8"]
    load_bundle(bundle)  # the device's own contract check accepts every variant


def test_a_decision_channel_beyond_a_dim_ort_resolves_is_refused_by_the_spec_check(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"decision\.channel: 3 is beyond the 1 values of 'y'"):
        _create(tmp_path, _model(tmp_path / "m.onnx", ["batch", "n"]), channel=3)
