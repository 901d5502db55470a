"""A state input that starts from a tensor, not a scalar fill (issue 42 point 4: vector initial states).

openWakeWord's package starts its rolling feature buffer from the embeddings of ten seconds of silence; a
state's `init` was a scalar only, so a bundle could start it only from zeros (and a hand-made flag state
inside the graph). `inputs[i].init` may name a .npy: `bundle create` copies it into the bundle
(`states/<input>.npy`), the manifest hashes it and the signature covers it, the loader checks its hash,
shape and dtype, and every stream (and every session after a reset) starts from it.
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import yaml
from sensor_streams import Served, recurrence_model
from waiting import wait_until

W, H, K, SR = 256, 6, 3, 16000
rng0 = np.random.default_rng(7)
WX = (rng0.standard_normal((W, H)) * 0.05).astype(np.float32)
U = (rng0.standard_normal((H, H)) * 0.6).astype(np.float32)
V = (rng0.standard_normal((H, K)) * 1.5).astype(np.float32)
S0 = np.linspace(-0.9, 0.9, H, dtype=np.float32)[None]  # the initial state: far from zeros


def _reference(x: np.ndarray, s0: np.ndarray) -> np.ndarray:
    s, out = s0[0].astype(np.float64), []
    for w in x.reshape(-1, W):
        s = np.tanh(w @ WX + s @ U)
        out.append(s @ V)
    return np.asarray(out)


def _audio(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.5, n).astype(np.float32)


def _build(tmp: Path, init: np.ndarray) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    np.save(tmp / "s0.npy", init)
    spec = {"name": "init-file", "version": 1, "label": "0.1.0", "task": "raw",
            "frame": {"kind": "sensor", "window": W, "channels": 1, "dtype": "float32", "sample_rate": SR},
            "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": "s0.npy",
                        "from_output": "stateN", "reset_on_gap_s": 1.0}],
            "preprocess": {"layout": "ncw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": K}}
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    np.savez(tmp / "golden.npz", raw=np.stack([_audio(8 * W, s).reshape(8, W, 1) for s in range(3)]))
    return create_bundle(CreateOptions(model=recurrence_model(tmp / "m.onnx", (1, W), WX, U, V), spec=tmp / "spec.yaml",
                                       calibration=tmp / "golden.npz", golden=tmp / "golden.npz", out=tmp / "bundle",
                                       int8=False))


def test_a_state_starts_from_the_tensor_file_the_bundle_carries_hashed(tmp_path: Path) -> None:
    from agent.bundle.load import load_bundle

    bundle = _build(tmp_path, S0)
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    assert manifest["inputs"][0]["init"] == "states/state.npy"
    assert "states/state.npy" in manifest["files"]  # hashed, so signed like every file
    np.testing.assert_array_equal(load_bundle(bundle).manifest.inputs[0].init_value, S0)  # type: ignore[attr-defined]

    x = _audio(12 * W, 11)
    served = Served(bundle, type="udp", host="127.0.0.1", port=0)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tx.sendto(x.astype("<f4").tobytes(), ("127.0.0.1", served.port))
        assert wait_until(lambda: len(served.results()) >= 12, 30), len(served.results())
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in served.results()])
        assert float(np.max(np.abs(got - _reference(x, S0)))) < 1e-4  # from the tensor, every window
        assert float(np.max(np.abs(got[0] - _reference(x, np.zeros_like(S0))[0]))) > 1e-2  # zeros would differ
    finally:
        tx.close()
        served.close()


def test_an_edited_init_file_is_refused_at_load_naming_the_file(tmp_path: Path) -> None:
    from agent.bundle.load import load_bundle
    from agent.errors import BundleError

    bundle = _build(tmp_path, S0)
    np.save(bundle / "states" / "state.npy", np.zeros_like(S0))
    with pytest.raises(BundleError, match=r"inputs\[0\]\.init: .*states/state.npy: hash mismatch"):
        load_bundle(bundle)


def test_an_init_file_of_another_shape_is_refused_at_build_naming_the_key(tmp_path: Path) -> None:
    from agent.errors import BundleError

    with pytest.raises(BundleError, match=r"key inputs\[0\]\.init: states/state.npy holds shape \[1, 5\], the "
                                          r"state 'state' is declared \[1, 6\]"):
        _build(tmp_path, np.zeros((1, 5), np.float32))
