"""The STFT-magnitude front-end compiled to ONNX (agent/bundle/frontends.py), judged against torch.stft.

The reference is torch's own STFT (torch 2.x in the references venv, ~/.cache/edge-agent/venv-real:
centred, reflect-padded, periodic Hann window, onesided), run in a subprocess by
scripts/stft_reference_run.py; skipped where that venv or torch is missing. The graph runs in ONNX
Runtime on the CPU provider; a bundle built with the front-end takes raw samples.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sensor_streams import CACHE
from frontend_bundles import mean_of_features_bundle

pytestmark = pytest.mark.real  # torch's answers come from the references venv (scripts/real_models.py makes it)

ROOT = Path(__file__).resolve().parents[2]
REF_PY = CACHE / "venv-real" / "bin" / "python"
BOUND = 1e-4  # declared: max |graph - torch| relative to the largest reference value


def _audio(n: int, batch: int = 2) -> np.ndarray:
    rng = np.random.default_rng(7)
    t = np.arange(n) / 16000.0
    chirp = np.sin(2 * np.pi * (200 + 3000 * t) * t)
    return (chirp[None, :] * rng.uniform(0.2, 1.0, (batch, 1)) + rng.normal(0, 0.1, (batch, n))).astype(np.float32)


# every torch reference the module needs, as (samples, batch, n_fft, hop, power): one subprocess for all
PARAMS = [(512, 128, 1), (400, 160, 2), (256, 100, 1)]
JOBS = [(8000, 2, *p) for p in PARAMS] + [(4000, 6, 256, 128, 1)]


def _torch_dist() -> str | None:
    """The torch distribution installed in the references venv (its dist-info name: torch-X.Y.Z), or None."""
    found = sorted(REF_PY.parent.parent.glob("lib/python*/site-packages/torch-*.dist-info"))
    return found[-1].name if found else None


@pytest.fixture(scope="module")
def torch_stft(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, np.ndarray]:
    """torch.stft of `_audio(samples, batch)` for each job, from one run of the references venv (the torch
    import is most of a run's cost), kept under the cache keyed by the torch distribution, the reference
    script and the audio: a warm run reads torch's own answers back instead of importing torch again."""
    if not REF_PY.exists():
        pytest.skip(f"{REF_PY}: the references venv is missing (scripts/real_models.py builds it)")
    script = ROOT / "scripts" / "stft_reference_run.py"
    audio = [_audio(samples, batch) for samples, batch, *_ in JOBS]
    key = hashlib.sha256(repr((_torch_dist(), JOBS)).encode() + script.read_bytes()
                         + b"".join(a.tobytes() for a in audio)).hexdigest()[:16]
    kept = CACHE / "stft-references" / f"{key}.npz"
    if _torch_dist() is not None and kept.exists():
        with np.load(kept) as z:
            return {job: z[f"ref{j}"] for j, job in enumerate(JOBS)}
    tmp = tmp_path_factory.mktemp("stft-refs")
    argv = []
    for j, (samples, batch, n_fft, hop, power) in enumerate(JOBS):
        np.save(tmp / f"audio{j}.npy", audio[j])
        argv += [str(tmp / f"audio{j}.npy"), str(n_fft), str(hop), str(power), str(tmp / f"ref{j}.npy")]
    r = subprocess.run([str(REF_PY), str(script), *argv], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named 'torch'" in r.stderr:
        pytest.skip("torch is not installed in the references venv")
    assert r.returncode == 0, r.stderr[-2000:]
    refs = {job: np.load(tmp / f"ref{j}.npy") for j, job in enumerate(JOBS)}
    if _torch_dist() is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_suffix(".part.npz")  # whole or absent: another worker may read it at once
        np.savez(part, **{f"ref{j}": refs[job] for j, job in enumerate(JOBS)})
        os.replace(part, kept)
    return refs


def _run(model: object, audio: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # type: ignore[attr-defined]
    return sess.run(None, {sess.get_inputs()[0].name: audio})[0]


@pytest.mark.parametrize("n_fft, hop, power", PARAMS)
def test_the_stft_graph_equals_torch_stft(torch_stft: dict, n_fft: int, hop: int, power: int) -> None:
    from agent.bundle.frontends import StftMagnitude, stft_magnitude_graph

    audio = _audio(8000)
    fe = StftMagnitude(samples=8000, n_fft=n_fft, hop=hop, power=power)
    got = _run(stft_magnitude_graph(fe), audio)
    want = torch_stft[(8000, 2, n_fft, hop, power)]
    assert got.shape == want.shape == (2, n_fft // 2 + 1, 1 + 8000 // hop)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert rel <= BOUND, rel


def test_a_bundle_with_the_stft_front_end_takes_raw_samples(tmp_path: Path, torch_stft: dict) -> None:
    import onnx

    samples, n_fft, hop = 4000, 256, 128
    freqs, frames = n_fft // 2 + 1, 1 + samples // hop
    audio = _audio(samples, batch=6)
    # a model over the spectrogram: the mean magnitude of each frequency bin
    bundle = mean_of_features_bundle(tmp_path, "spec-mean",
                                     {"type": "stft_magnitude", "samples": samples, "n_fft": n_fft, "hop": hop},
                                     ("spec", ["batch", freqs, frames]), 2, audio)
    got = _run(onnx.load(str(bundle / "model_fp32.onnx")), audio[:3])
    want = torch_stft[(samples, 6, n_fft, hop, 1)][:3].mean(axis=2)  # torch's STFT is row by row
    assert float(np.max(np.abs(got - want)) / np.max(want)) <= BOUND
