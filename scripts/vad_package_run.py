#!/usr/bin/env python3
"""Silero VAD's OWN results on given audio, for the sensor-stream tests (tests/serving/test_sensor_*.py).

Runs inside $EDGE_AGENT_CACHE/real-models/../venv-real (silero-vad and torch installed); nothing of the agent
is imported. Reads a JSON job: {"golden": {"out": npz, "sequences": n} | null, "streams": [{"audio": f32 file,
"segments": {threshold, neg_threshold, min_speech_duration_ms, min_silence_duration_ms} | null}]} and
prints JSON: per stream the package's per-chunk speech probabilities (a fresh OnnxWrapper, chunks of 512
samples at 16 kHz, a last partial chunk dropped) and, when asked, `get_speech_timestamps` segments in
samples (speech_pad_ms 0). `golden` writes a sample set in scripts/real_references.py's format.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SR, HOP = 16000, 512


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    import silero_vad
    import torch
    from silero_vad.utils_vad import OnnxWrapper, get_speech_timestamps

    torch.set_num_threads(1)
    model = OnnxWrapper(str(Path(silero_vad.__file__).parent / "data" / "silero_vad.onnx"), force_onnx_cpu=True)
    out: dict = {"streams": []}
    if job.get("golden"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import real_references

        arrays, _ = real_references.build_vad(int(job["golden"]["sequences"]), int(job["golden"].get("seed", 2000)))
        np.savez(job["golden"]["out"], **arrays)
    for s in job.get("streams", []):
        audio = np.fromfile(s["audio"], "<f4")
        model.reset_states()
        probs = [float(model(torch.from_numpy(audio[i:i + HOP].copy()), SR).item())
                 for i in range(0, len(audio) - HOP + 1, HOP)]
        item: dict = {"probabilities": probs}
        seg = s.get("segments")
        if seg:
            model.reset_states()
            ts = get_speech_timestamps(torch.from_numpy(audio), model, threshold=seg["threshold"],
                                       neg_threshold=seg["neg_threshold"], sampling_rate=SR,
                                       min_speech_duration_ms=seg["min_speech_duration_ms"],
                                       min_silence_duration_ms=seg["min_silence_duration_ms"], speech_pad_ms=0)
            item["segments"] = [[int(t["start"]), int(t["end"])] for t in ts]
        out["streams"].append(item)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
