"""A sensor bundle with an ONNX front-end, for front-end tests: the model behind the front-end takes the
mean of its features over one axis, so what the bundle answers is the front-end's output, reduced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml


def mean_of_features_bundle(tmp: Path, name: str, frontend: dict[str, Any], features: tuple[str, list[Any]],
                            axis: int, audio: np.ndarray) -> Path:
    """`features` is the front-end output's (name, shape); `audio` (windows x samples) calibrates the
    bundle and its first 3 windows are the golden set. Made with `bundle create`, FP32 only."""
    import onnx
    from onnx import TensorProto, helper

    from agent.bundle.create import CreateOptions, create_bundle

    feat, shape = features
    out_shape = [d for i, d in enumerate(shape) if i != axis]
    g = helper.make_graph([helper.make_node("ReduceMean", [feat], ["y"], axes=[axis], keepdims=0)], "m",
                          [helper.make_tensor_value_info(feat, TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp / "m.onnx"))
    np.savez(tmp / "calib.npz", raw=audio[:, :, None])
    np.savez(tmp / "golden.npz", raw=audio[:3, :, None])
    samples = audio.shape[1]
    spec = {"name": name, "version": 1, "label": "0.1.0", "task": "raw", "frontend": frontend,
            "frame": {"kind": "sensor", "window": samples, "channels": 1, "dtype": "float32", "sample_rate": 16000},
            "preprocess": {"layout": "nw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["y"], "max_values": 4}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    bundle = create_bundle(CreateOptions(model=tmp / "m.onnx", spec=tmp / "spec.yaml", calibration=tmp / "calib.npz",
                                         golden=tmp / "golden.npz", out=tmp / "bundle", int8=False))
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    assert manifest["input"]["shape"] == ["batch", samples]
    return bundle
