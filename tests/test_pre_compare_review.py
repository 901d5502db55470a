"""Review of issue 41's preprocessing check across devices: the cases it got wrong.

- a stateful image model (golden sequences) on a device whose resize rounds differently crashed the proof;
- a device tensor holding NaN where the bundle's is finite passed the preprocessing check (NaN compares false);
- a difference that is not a whole number of 8-bit levels (a mean, std or scale a little off) passed as rounding:
  two uint8 images through the same scale, mean and std differ only by whole levels;
- a wrong scale (1/256 for 1/255) was explained as a wrong mean.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.load import load_bundle
from agent.proof.pre_compare import Levels, compare, explain
from agent.proof.selftest import SelftestOptions, check_preprocessing, run_selftest
from agent.spec import preprocess
from agent.testing import rewrite_manifest

LEVEL = (1 / 255) / 0.25  # the demo's scale / std: one 8-bit level in tensor units
FAST = SelftestOptions(latency_runs=10)
S, H, K = 4, 6, 3  # model input side, state width, classes
T, N = 5, 4  # steps per sequence, sequences per set


def _levels() -> Levels:
    return Levels((LEVEL,) * 3, (2.0,) * 3, -3)


def _resize_one_level_off(monkeypatch: pytest.MonkeyPatch, fraction: float = 0.27) -> None:
    """This device's resize moves `fraction` of the values one level either way (arm64's INTER_LINEAR vs x86's)."""
    rng = np.random.default_rng(0)
    own = preprocess._resize

    def resize(img: np.ndarray, width: int, height: int, r: object) -> np.ndarray:
        out = own(img, width, height, r).astype(np.int16)
        moved = (rng.random(out.shape) < fraction) * rng.choice([-1, 1], out.shape)
        return np.clip(out + moved, 0, 255).astype(np.uint8)

    monkeypatch.setattr(preprocess, "_resize", resize)


def _image_stateful_model(path: Path) -> Path:
    """stateN = tanh(flatten(image) W + state U); scores = stateN V: a tiny video model with state."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((3 * S * S, H)) * 0.2).astype(np.float32), "wx"),
             numpy_helper.from_array((rng.standard_normal((H, H)) * 0.5).astype(np.float32), "u"),
             numpy_helper.from_array((rng.standard_normal((H, K)) * 1.5).astype(np.float32), "v")]
    nodes = [helper.make_node("Flatten", ["image"], ["f"]), helper.make_node("MatMul", ["f", "wx"], ["a"]),
             helper.make_node("MatMul", ["state", "u"], ["r"]), helper.make_node("Add", ["a", "r"], ["z"]),
             helper.make_node("Tanh", ["z"], ["stateN"]), helper.make_node("MatMul", ["stateN", "v"], ["scores"])]
    graph = helper.make_graph(
        nodes, "image_stateful",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, S, S]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, ["batch", H])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", K]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, ["batch", H])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _frames(seed: int) -> np.ndarray:
    """Smooth 8x8 RGB sequences (N, T, 8, 8, 3)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:8, 0:8]
    out = np.empty((N, T, 8, 8, 3), np.uint8)
    for i in range(N):
        for t in range(T):
            for c in range(3):
                a, b, p = rng.uniform(-12, 12, 3)
                out[i, t, :, :, c] = np.clip(128 + a * (x - 3.5) + b * (y - 3.5) + p, 0, 255)
    return out


@pytest.fixture(scope="module")
def image_stateful_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("image_stateful")
    spec = {
        "name": "tiny-video-stateful", "version": 1, "label": "0.1.0", "task": "classification",
        "frame": {"kind": "image", "height": 8, "width": 8, "channels": 3, "color": "rgb"},
        "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": 0.0,
                    "from_output": "stateN", "reset_on_gap_s": 1.0}],
        "preprocess": {"resize": {"width": S, "height": S, "mode": "stretch", "interpolation": "linear"},
                       "scale": 1 / 255, "mean": [0.5], "std": [0.25], "layout": "nchw", "dtype": "float32"},
        "postprocess": {"type": "classification", "output": "scores", "top_k": 1, "apply_softmax": False},
    }
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    for name, seed in (("calib", 1), ("golden", 2), ("held", 3)):
        np.savez(d / f"{name}.npz", raw=_frames(seed))
    return create_bundle(CreateOptions(model=_image_stateful_model(d / "model.onnx"), spec=d / "spec.yaml",
                                       calibration=d / "calib.npz", golden=d / "golden.npz", heldout=d / "held.npz",
                                       out=d / "bundle", min_agreement=0.5))


def test_a_stateful_image_model_proves_on_a_device_whose_resize_rounds_differently(
    image_stateful_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Golden sequences take the rounding path too: the proof judged the size probes there with a pre stage only
    bound for single frames (UnboundLocalError: 'pre'), so every candidate failed with an inference error."""
    b = load_bundle(image_stateful_bundle)
    assert any(g.sequence for g in b.golden())
    _resize_one_level_off(monkeypatch)
    pc, _ = check_preprocessing(b, b.golden())
    assert pc.rounding, pc
    report = run_selftest(b, tmp_path / "state", FAST)
    for r in report.results:
        assert not any("inference error" in x for x in r.reasons), r.reasons
    assert report.selected is not None, [r.reasons for r in report.results]
