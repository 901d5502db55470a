#!/usr/bin/env python3
"""Smart Turn v3.2's OWN results (pipecat-ai 1.14.0) on given audio, for tests/bundle/test_sensor_frontend.py.

Runs the package's own code for everything but the wrapper class: its `_whisper_features.py` (numpy,
extracted by scripts/fetch_smart_turn.py) and its bundled model, in an ONNX Runtime session made as
pipecat's LocalSmartTurnAnalyzerV3 makes it; the audio handling is that class's `_predict_endpoint`
(the last 8 s, zeros on the left when shorter; probability > 0.5 is a finished turn). The class itself
needs loguru and soxr, which this machine does not have. Job (JSON): {"audio": f32 file, "ends": [sample
index, ...], "features": bool} -> prints JSON {"probabilities": [...], "features": [[...]] (when asked)}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent")) / "real-models" / "smart-turn"
SAMPLES = 8 * 16000


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    spec = importlib.util.spec_from_file_location("whisper_features", CACHE / "whisper_features.py")
    wf = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(wf)
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(CACHE / "model.onnx"), sess_options=so, providers=["CPUExecutionProvider"])
    audio = np.fromfile(job["audio"], "<f4")
    probs, feats = [], []
    for end in job["ends"]:
        a = audio[:end][-SAMPLES:]
        if len(a) < SAMPLES:
            a = np.pad(a, (SAMPLES - len(a), 0), mode="constant", constant_values=0)
        f = wf.compute_whisper_log_mel_features(a, do_normalize=True)
        probs.append(float(sess.run(None, {"input_features": f[None]})[0][0].item()))
        if job.get("features"):
            feats.append(f)
    out: dict = {"probabilities": probs}
    if feats:
        np.save(job["features_out"], np.stack(feats))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
