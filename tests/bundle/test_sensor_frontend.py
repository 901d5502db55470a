"""A real audio model with a log-mel front-end: pipecat's Smart Turn v3.2 (already QDQ-quantised, a
Whisper log-mel of the last 8 s -> one end-of-turn probability), served from raw samples.

The front-end is compiled to ONNX (agent/bundle/frontends.py) and merged before the model by `bundle
create`; it is judged against the package's own features, the bundle against the package's own
end-to-end decisions. The package's code runs in a subprocess (scripts/smart_turn_package_run.py);
skipped where scripts/fetch_smart_turn.py has not fetched the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sensor_streams import CACHE, Served, speech
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
TURN = CACHE / "real-models" / "smart-turn"
SAMPLES, SR, HOP = 128000, 16000, 8000
FEATURE_BOUND = 1e-4  # declared: |front-end graph - package features| (log-mel units, roughly [-1, 1])
MIN_DECISION_AGREEMENT = 0.9  # declared: served decisions vs the package's; an INT8 model amplifies 1e-5 input changes
SPEC = {
    "name": "smart-turn", "version": 1, "label": "3.2.0", "task": "raw",
    "source": {"framework": "onnx", "description": "pipecat-ai 1.14.0 smart-turn-v3.2-cpu (BSD-2-Clause)"},
    "frontend": {"type": "whisper_log_mel", "samples": SAMPLES},
    "frame": {"kind": "sensor", "window": SAMPLES, "hop": HOP, "channels": 1, "dtype": "float32", "sample_rate": SR,
              "padding": {"mode": "zero", "samples": SAMPLES - HOP}},
    "preprocess": {"layout": "nw", "dtype": "float32"},
    "postprocess": {"type": "raw", "outputs": ["logits"], "max_values": 1,
                    "decision": {"rule": "threshold", "output": "logits", "threshold": 0.5,
                                 "labels": ["incomplete", "complete"]}},
}
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.real]  # an 8 MB transformer over 8 s windows, the package in a subprocess


@pytest.fixture(scope="module")
def turn() -> Path:
    if not (TURN / "model.onnx").exists() or not (TURN / "whisper_features.py").exists():
        pytest.skip(f"{TURN}: not fetched (python scripts/fetch_smart_turn.py)")
    return TURN


def package(work: Path, audio: np.ndarray, ends: list[int], features: bool = False) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    stamp = time.monotonic_ns()
    path = work / f"turn-{stamp}.f32"
    audio.astype("<f4").tofile(path)
    job = {"audio": str(path), "ends": ends, "features": features, "features_out": str(work / f"feat-{stamp}.npy")}
    (work / f"job-{stamp}.json").write_text(json.dumps(job))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "smart_turn_package_run.py"), str(work / f"job-{stamp}.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    if features:
        out["features"] = np.load(job["features_out"])
    return out


def _audio(seed: int, seconds: float) -> np.ndarray:
    a = speech(seed, seconds)
    return a / max(1e-6, float(np.max(np.abs(a)))) * 0.5


def test_the_front_end_graph_reproduces_the_packages_log_mel_within_its_bound(turn: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    from agent.bundle.frontends import WhisperLogMel, whisper_log_mel_graph

    a = _audio(51, 10.0)
    ends = [3000, 64000, SAMPLES, len(a)]  # left-padded (3000 and 64000 samples of audio) and full windows
    want = package(tmp_path, a, ends, features=True)["features"]
    sess = ort.InferenceSession(whisper_log_mel_graph(WhisperLogMel()).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    worst = 0.0
    for end, ref in zip(ends, want):
        x = a[:end][-SAMPLES:]
        x = np.pad(x, (SAMPLES - len(x), 0))
        got = sess.run(None, {"audio": x[None].astype(np.float32)})[0][0]
        worst = max(worst, float(np.max(np.abs(got - ref))))
    print(f"\nfront-end vs package log-mel: worst |diff| {worst:.2e} (bound {FEATURE_BOUND})")
    assert worst <= FEATURE_BOUND


@pytest.fixture(scope="module")
def turn_bundle(turn: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    d = tmp_path_factory.mktemp("turn")
    a = _audio(52, 12.0)
    ends = [40000, 96000, SAMPLES, 160000, len(a)]
    want = package(d, a, ends)["probabilities"]
    raw = np.stack([np.pad(a[:e][-SAMPLES:], (SAMPLES - len(a[:e][-SAMPLES:]), 0)) for e in ends])[..., None]
    np.savez(d / "golden.npz", raw=raw.astype(np.float32), **{"reference.logits": np.asarray(want, np.float32)[:, None]})
    (d / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    return create_bundle(CreateOptions(model=turn / "model.onnx", spec=d / "spec.yaml", calibration=d / "golden.npz",
                                       golden=d / "golden.npz", out=d / "bundle"))


def test_an_already_quantised_model_behind_a_front_end_builds_as_int8_and_passes_the_selftest(
        turn_bundle: Path, tmp_path: Path) -> None:
    m = yaml.safe_load((turn_bundle / "bundle.yaml").read_text())
    assert [(v["name"], v["precision"]) for v in m["variants"]] == [("int8", "int8")]
    assert m["variants"][0]["quantization"]["format"] == "prequantized"
    assert m["input"]["shape"] == ["batch", SAMPLES] and "whisper_log_mel" in m["source"]["description"]
    r = subprocess.run([sys.executable, "-m", "agent", "selftest", "--bundle", str(turn_bundle), "--state-dir",
                        str(tmp_path / "state"), "--json", "--no-cache"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["selected"]["variant"] == "int8"
    c = next(c for c in doc["candidates"] if c["variant"] == "int8" and c.get("passed"))
    assert c["fidelity"]["metrics"]["decision_agreement"] == 1.0


def test_served_from_a_stream_each_decision_agrees_with_the_packages_on_the_same_last_8_s(
        turn_bundle: Path, tmp_path: Path) -> None:
    a = _audio(53, 10.0)
    path = tmp_path / "audio.f32"
    a.astype("<f4").tofile(path)
    served = Served(turn_bundle, type="file", path=path)
    try:
        n = len(a) // HOP  # with 7.5 s of zeros first, a window every 0.5 s from the first 0.5 s on
        assert wait_until(lambda: len(served.sink.results) == n, 300), len(served.sink.results)
        results = [r["result"] for r in served.sink.results]
    finally:
        served.close()
    ends = [r["stream"]["end_sample"] for r in results]
    assert ends == [HOP * (k + 1) for k in range(n)]
    want = package(tmp_path, a, ends)["probabilities"]
    ours = [r["decision"]["value"] for r in results]
    agree = float(np.mean([(p >= 0.5) == (q > 0.5) for p, q in zip(ours, want)]))
    worst = float(np.max(np.abs(np.asarray(ours) - np.asarray(want))))
    print(f"\nsmart-turn served vs package: decision agreement {agree:.3f} over {n} windows, worst |p| {worst:.3f}")
    assert agree >= MIN_DECISION_AGREEMENT
