"""Block spectra compiled to ONNX (issue 42 point 4): a plain `rfft` front-end (magnitude, power or the
complex spectrum) and the STFT's complex output, and a front-end in front of a stateful model.

Judged against numpy's own FFT (`numpy.fft.rfft`, what DTLN's packages call on each 512-sample block) and a
numpy STFT written as torch.stft defines it (centred, reflect-padded, periodic Hann); the magnitude STFT is
already judged against torch itself (tests/bundle/test_sensor_frontend_stft.py). Before: `rfft` and `complex`
were unknown keys, and a model with a state input could not take a front-end at all ("a front-end feeds a
model with one input").
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import yaml
from waiting import wait_until

BOUND = 1e-5  # declared: max |graph - numpy| / max |numpy| (float32 DFT by Conv against float64 FFT)


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    return (np.sin(2 * np.pi * rng.uniform(100, 3000) * t) * 0.5 + rng.normal(0, 0.1, n)).astype(np.float32)


def _run(model: object, audio: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # type: ignore[attr-defined]
    return sess.run(None, {"audio": audio})[0]


def _window(kind: str, n: int) -> np.ndarray:
    return {"rectangular": np.ones(n), "hann": np.hanning(n + 1)[:-1], "hamming": np.hamming(n + 1)[:-1]}[kind]


@pytest.mark.parametrize("n", [512, 400])
@pytest.mark.parametrize("window", ["rectangular", "hann", "hamming"])
@pytest.mark.parametrize("output", ["magnitude", "power", "complex"])
def test_the_rfft_graph_equals_numpys_rfft(n: int, window: str, output: str) -> None:
    from agent.bundle.frontends import frontend_from_dict

    fe = frontend_from_dict({"type": "rfft", "samples": n, "window": window, "output": output}, "spec.yaml")
    audio = np.stack([_audio(n, 1), _audio(n, 2)])
    got = _run(fe.graph(17), audio)
    spec = np.fft.rfft(audio.astype(np.float64) * _window(window, n), axis=-1)[:, None, :]  # [B, 1, F]
    want = {"magnitude": np.abs(spec), "power": np.abs(spec) ** 2,
            "complex": np.stack([spec.real, spec.imag], axis=-1)}[output]
    assert got.shape == want.shape == (2, *fe.out_dims)
    assert float(np.max(np.abs(got - want))) <= BOUND * float(np.max(np.abs(want)))


@pytest.mark.parametrize("n_fft, hop, window", [(512, 128, "hann"), (400, 160, "hann"), (512, 128, "hamming"),
                                                (400, 160, "rectangular")])
def test_the_stft_graph_gives_the_complex_spectrum(n_fft: int, hop: int, window: str) -> None:
    """And a window other than Hann (torch.stft(window=torch.hamming_window(n_fft)): periodic)."""
    from agent.bundle.frontends import frontend_from_dict

    samples = 8000
    fe = frontend_from_dict({"type": "stft_magnitude", "samples": samples, "n_fft": n_fft, "hop": hop,
                             "complex": True, "window": window}, "spec.yaml")
    audio = np.stack([_audio(samples, 3), _audio(samples, 4)])
    got = _run(fe.graph(17), audio)
    padded = np.pad(audio.astype(np.float64), ((0, 0), (n_fft // 2, n_fft // 2)), mode="reflect")
    frames = np.stack([padded[:, t * hop:t * hop + n_fft] for t in range(1 + samples // hop)], axis=1)
    spec = np.fft.rfft(frames * _window(window, n_fft), axis=-1).transpose(0, 2, 1)  # [B, F, T]
    want = np.stack([spec.real, spec.imag], axis=-1)
    assert got.shape == want.shape == (2, *fe.out_dims)
    assert float(np.max(np.abs(got - want))) <= BOUND * float(np.max(np.abs(want)))


def test_a_bad_rfft_block_is_refused_naming_the_key() -> None:
    from agent.bundle.frontends import frontend_from_dict
    from agent.errors import BundleError

    with pytest.raises(BundleError, match="key frontend: output 'phase' is not one of"):
        frontend_from_dict({"type": "rfft", "samples": 512, "output": "phase"}, "spec.yaml")
    with pytest.raises(BundleError, match="key frontend: window 'povey' is not one of"):
        frontend_from_dict({"type": "rfft", "samples": 512, "window": "povey"}, "spec.yaml")


W, H, K, SR = 512, 6, 3, 16000
F = W // 2 + 1
rng0 = np.random.default_rng(42)
WX = (rng0.standard_normal((F, H)) * 0.02).astype(np.float32)
U = (rng0.standard_normal((H, H)) * 0.5).astype(np.float32)
V = (rng0.standard_normal((H, K)) * 1.5).astype(np.float32)


def _reference(stream: np.ndarray) -> np.ndarray:
    """A stateful model over each block's magnitude spectrum, as a package that calls np.fft.rfft would run it."""
    s, out = np.zeros(H), []
    for w in stream.reshape(-1, W):
        s = np.tanh(np.abs(np.fft.rfft(w.astype(np.float64))) @ WX + s @ U)
        out.append(s @ V)
    return np.asarray(out)


def test_a_stateful_model_behind_an_rfft_front_end_is_built_and_served_from_raw_samples(tmp_path: Path) -> None:
    """A model whose frame input is a block's magnitude spectrum [B, 1, F] and which carries a state (DTLN's
    first model takes |rfft| of each 512-sample block and its LSTM states)."""
    from sensor_streams import Served, recurrence_model

    from agent.bundle.create import CreateOptions, create_bundle

    model = recurrence_model(tmp_path / "m.onnx", (1, F), WX, U, V)
    spec = {"name": "rfft-state", "version": 1, "label": "0.1.0", "task": "raw",
            "frontend": {"type": "rfft", "samples": W, "output": "magnitude"},
            "frame": {"kind": "sensor", "window": W, "channels": 1, "dtype": "float32", "sample_rate": SR},
            "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": 0.0,
                        "from_output": "stateN", "reset_on_gap_s": 1.0}],
            "preprocess": {"layout": "nw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": K}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    np.savez(tmp_path / "golden.npz", raw=np.stack([_audio(12 * W, s).reshape(12, W, 1) for s in range(4)]))
    bundle = create_bundle(CreateOptions(model=model, spec=tmp_path / "spec.yaml", calibration=tmp_path / "golden.npz",
                                         golden=tmp_path / "golden.npz", out=tmp_path / "bundle", int8=False))
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    assert manifest["input"]["shape"] == ["batch", W]  # raw samples in

    x = _audio(20 * W, 9)
    served = Served(bundle, type="udp", host="127.0.0.1", port=0)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i in range(0, len(x), 4 * W):
            tx.sendto(x[i:i + 4 * W].astype("<f4").tobytes(), ("127.0.0.1", served.port))
        assert wait_until(lambda: len(served.results()) >= 20, 30), len(served.results())
        rs = served.results()
        assert [(r["result"]["stream"]["session"], r["result"]["stream"]["window"]) for r in rs] == \
            [(1, k) for k in range(20)]
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in rs])
        assert float(np.max(np.abs(got - _reference(x)))) < 1e-4
    finally:
        tx.close()
        served.close()


def test_a_model_with_a_state_input_takes_an_existing_front_end(tmp_path: Path) -> None:
    """Before: `bundle create` refused any front-end for a stateful model ("the model takes ['features',
    'state']; a front-end feeds a model with one input"), so every front-end step of a stateful audio model
    had to be merged into its graph by hand."""
    import onnxruntime as ort

    from sensor_streams import recurrence_model

    from agent.bundle.create import CreateOptions, create_bundle

    n_fft, hop, samples = 256, 128, 512
    frames, freqs = 1 + samples // hop, n_fft // 2 + 1
    wx = (np.random.default_rng(5).standard_normal((freqs * frames, H)) * 0.01).astype(np.float32)
    model = recurrence_model(tmp_path / "m.onnx", (freqs, frames), wx, U, V)
    spec = {"name": "stft-state", "version": 1, "label": "0.1.0", "task": "raw",
            "frontend": {"type": "stft_magnitude", "samples": samples, "n_fft": n_fft, "hop": hop},
            "frame": {"kind": "sensor", "window": samples, "channels": 1, "dtype": "float32", "sample_rate": SR},
            "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": 0.0,
                        "from_output": "stateN"}],
            "preprocess": {"layout": "nw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": K}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    np.savez(tmp_path / "golden.npz", raw=np.stack([_audio(6 * samples, s).reshape(6, samples, 1) for s in range(3)]))
    bundle = create_bundle(CreateOptions(model=model, spec=tmp_path / "spec.yaml", calibration=tmp_path / "golden.npz",
                                         golden=tmp_path / "golden.npz", out=tmp_path / "bundle", int8=False))
    sess = ort.InferenceSession(str(bundle / "model_fp32.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in sess.get_inputs()) == ["audio", "state"]
    x, s = _audio(3 * samples, 7).reshape(3, samples), np.zeros((1, H), np.float32)
    window, want_s = np.hanning(n_fft + 1)[:-1], np.zeros(H)
    for w in x:
        got, s = sess.run(["scores", "stateN"], {"audio": w[None], "state": s})
        padded = np.pad(w.astype(np.float64), n_fft // 2, mode="reflect")
        mag = np.abs(np.fft.rfft(np.stack([padded[t * hop:t * hop + n_fft] for t in range(frames)]) * window)).T
        want_s = np.tanh(mag.reshape(-1) @ wx + want_s @ U)
        assert float(np.max(np.abs(got[0] - want_s @ V))) < 1e-3
