"""Review of issue 44 point 4: "a mismatch that would change the answers is refused".

`source.hop` overrides the bundle's `frame.hop`. A stateful model (Silero VAD: window 576 = 512 own samples
+ 64 of context) advances its state once per hop it was built for; served with `source.hop: 256` every
sample is fed to the state twice and every answer changes -- yet neither `config check`
(stream_problems) nor the source at boot says a word, while a declared sample rate or channel count
that differs is refused naming the key.
"""

from __future__ import annotations

import pytest

from agent.config import SourceConfig
from agent.errors import ConfigError
from agent.vocabulary.manifest import ExtraInput, frame_from_dict

STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),)
FRAME = {"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 576, "hop": 512}


def test_config_check_refuses_a_source_hop_that_is_not_a_stateful_bundles_frame_hop() -> None:
    from agent.serving.sensors import stream_problems

    frame = frame_from_dict(FRAME, STATE)
    problems = stream_problems(frame, STATE, [SourceConfig(type="udp", hop=256)], ["source"])
    assert any("source.hop" in p for p in problems), problems


def test_the_boot_refuses_a_source_hop_that_is_not_a_stateful_bundles_frame_hop() -> None:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict(FRAME, STATE)
    src = None
    try:
        with pytest.raises(ConfigError, match=r"source\.hop"):
            src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, hop=256), frame)
    finally:
        if src is not None:
            src.close()
