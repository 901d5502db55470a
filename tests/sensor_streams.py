"""Shared parts of the sensor-stream tests: a real Silero VAD bundle and the package's own results.

The bundle is built by `bundle create` from the cached model (scripts/real_models.py fetch) with a small
golden set made by the package; the package's per-window probabilities and speech segments for each
test stream come from scripts/vad_package_run.py inside the references venv (silero-vad + torch). Both are
skipped, not failed, where the cache or that venv is missing (an offline checkout).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
VAD_MODEL = CACHE / "real-models" / "vad" / "model.onnx"
VENV_REAL_PY = CACHE / "venv-real" / "bin" / "python"
SR, HOP, CONTEXT = 16000, 512, 64
# the VAD spec of scripts/specs/real/vad.yaml, with stream time: 16 kHz, windows of 576 (512 + 64 of the
# previous window as context), and 64 zeros before each stream's first sample -- what the package's own
# wrapper does at the start of a stream, so a stream is sent as plain audio
VAD_FRAME = {"kind": "sensor", "window": HOP + CONTEXT, "hop": HOP, "channels": 1, "dtype": "float32",
             "sample_rate": SR, "padding": {"mode": "zero", "samples": CONTEXT}}


def recurrence_model(path: Path, window: tuple[int, int], wx: np.ndarray, u: np.ndarray, v: np.ndarray) -> Path:
    """A small stateful model: stateN = tanh(flatten(window) wx + state u); scores = stateN v. `window` is its
    (channels, samples); the state's width and the scores' count are u's and v's."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    h, k = u.shape[0], v.shape[1]
    nodes = [helper.make_node("Flatten", ["window"], ["f"]), helper.make_node("MatMul", ["f", "wx"], ["a"]),
             helper.make_node("MatMul", ["state", "u"], ["r"]), helper.make_node("Add", ["a", "r"], ["z"]),
             helper.make_node("Tanh", ["z"], ["stateN"]), helper.make_node("MatMul", ["stateN", "v"], ["scores"])]
    graph = helper.make_graph(
        nodes, "recurrence",
        [helper.make_tensor_value_info("window", TensorProto.FLOAT, ["batch", *window]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, ["batch", h])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", k]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, ["batch", h])],
        initializer=[numpy_helper.from_array(wx, "wx"), numpy_helper.from_array(u, "u"), numpy_helper.from_array(v, "v")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def speech(seed: int, seconds: float) -> np.ndarray:
    """Speech-like audio (scripts/real_references.py's voice), a whole number of 512-sample chunks."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import real_references

    n = int(seconds * SR) // HOP * HOP
    return real_references.speech_like(np.random.default_rng(seed), n, SR)


def require_vad() -> None:
    if not VAD_MODEL.exists():
        pytest.skip(f"{VAD_MODEL} not fetched (scripts/real_models.py fetch vad)")
    if not VENV_REAL_PY.exists():
        pytest.skip(f"{VENV_REAL_PY}: the references venv with silero-vad is missing (scripts/real_models.py references)")


def package_run(work: Path, streams: Iterable[np.ndarray], segments: dict[str, Any] | None = None,
                golden: Path | None = None) -> list[dict[str, Any]]:
    """The package's own results (OnnxWrapper, fresh per stream) for each stream."""
    require_vad()
    work.mkdir(parents=True, exist_ok=True)
    items = []
    for i, a in enumerate(streams):
        path = work / f"pkg-{time.monotonic_ns()}-{i}.f32"
        np.asarray(a, "<f4").tofile(path)
        items.append({"audio": str(path), "segments": segments})
    job = work / f"job-{time.monotonic_ns()}.json"
    job.write_text(json.dumps({"golden": {"out": str(golden), "sequences": 2} if golden else None, "streams": items}))
    r = subprocess.run([str(VENV_REAL_PY), str(ROOT / "scripts" / "vad_package_run.py"), str(job)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["streams"]


def build_vad_bundle(work: Path, frame: dict[str, Any] | None = None, postprocess: dict[str, Any] | None = None,
                     reset_on_gap_s: float | None = 1.0, extra: dict[str, Any] | None = None) -> Path:
    """`bundle create` of the real Silero VAD with the given frame and postprocess (FP32 only: its INT8
    quantises nothing, see tests/e2e/test_real_models.py)."""
    require_vad()
    work.mkdir(parents=True, exist_ok=True)
    golden = work / "golden.npz"
    if not golden.exists():
        package_run(work, [], golden=golden)
    spec = yaml.safe_load((ROOT / "scripts" / "specs" / "real" / "vad.yaml").read_text())
    spec["frame"] = frame or VAD_FRAME
    state = spec["inputs"][1]
    if reset_on_gap_s is None:
        state.pop("reset_on_gap_s", None)
    else:
        state["reset_on_gap_s"] = reset_on_gap_s
    if postprocess is not None:
        spec["postprocess"] = postprocess
    spec.update(extra or {})
    name = f"bundle-{time.monotonic_ns()}"
    (work / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    out = work / name
    r = subprocess.run([sys.executable, "-m", "agent", "bundle", "create", "--model", str(VAD_MODEL),
                        "--spec", str(work / f"{name}.yaml"), "--calibration", str(golden), "--golden", str(golden),
                        "--out", str(out), "--no-int8"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def engine_for(bundle: Path) -> Any:
    from agent.bundle.load import load_bundle
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine

    b = load_bundle(bundle)
    v = b.manifest.variants[0]  # fp32, or the int8 an already-quantised model is kept as
    return build_engine(b, Candidate(CPU, v.name, v.precision), SessionSettings(intra_op_threads=1))


class Served:
    """A real pipeline serving one source config with the bundle's engine into a list."""

    def __init__(self, bundle: Path, **source: Any):
        from agent.config import PipelineConfig, SourceConfig
        from agent.serving.pipeline import Pipeline
        from agent.serving.sources import is_lossless, open_source
        from agent.testing import ListSink

        self.engine = engine_for(bundle)
        self.cfg = SourceConfig(**source)
        self.source = open_source(self.cfg, self.engine.bundle.manifest.frame)
        self.sink = ListSink()
        self.lossless = is_lossless(self.cfg, self.source)
        self.pipeline = Pipeline(self.source, self.engine, self.sink, PipelineConfig(inference_workers=1, max_batch=1),
                                 self.lossless).start()

    @property
    def port(self) -> int:
        return int(self.source.port)

    def results(self, stream: str | None = None, session: int | None = None) -> list[dict[str, Any]]:
        return [r for r in list(self.sink.results)
                if (stream is None or r["result"]["stream"]["name"] == stream)
                and (session is None or r["result"]["stream"]["session"] == session)]

    def close(self) -> None:
        self.pipeline.stop()
        self.pipeline.join(timeout=15)
        self.source.close()


def probability(r: dict[str, Any]) -> float:
    res = r["result"]
    if "decision" in res:
        return float(res["decision"]["value"])
    return float(res["outputs"]["output"]["values"][0])


def send_chunks(sock: socket.socket, port: int, audio: np.ndarray, chunk: int = HOP, pace_s: float = 0.0,
                realtime: bool = False) -> None:
    """Datagrams of `chunk` samples: paced by `pace_s`, or in real time against an absolute schedule."""
    t0 = time.monotonic()
    for k, i in enumerate(range(0, len(audio), chunk)):
        if realtime:
            delay = t0 + k * chunk / SR - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        sock.sendto(np.asarray(audio[i:i + chunk], "<f4").tobytes(), ("127.0.0.1", port))
        if pace_s:
            time.sleep(pace_s)
