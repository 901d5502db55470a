"""MQTT `payload: samples` with `framing: seq32`: a payload the broker never delivered (a broker drops QoS 1
messages queued beyond its limit for a subscriber that is behind, without a word) is a counted hole that
resets the state; unnumbered payloads into a stateful bundle are warned of by `config check` (issue 44
point 3: lossless in order, or resets and says so)."""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),)
FRAME = {"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256}


def test_unnumbered_mqtt_samples_into_a_stateful_bundle_are_refused_by_config_check_and_at_boot() -> None:
    """Issue 44 point 3: a source that cannot keep the stateful contract is refused. A broker drops what it
    queued beyond its limit without a word, and unnumbered payloads cannot show the hole (the review: 710 of
    1,024 windows served from a default Mosquitto, lost_samples 0, the state carried across)."""
    from agent.errors import ConfigError
    from agent.serving.sensors import SensorSource, stream_problems

    frame = frame_from_dict(FRAME, STATE)
    plain = SourceConfig(type="mqtt", topic="a", payload="samples")
    framed = SourceConfig(type="mqtt", topic="a", payload="samples", framing="seq32")
    (problem,) = stream_problems(frame, STATE, [plain], ["source"])
    assert problem.startswith("key source.framing: none") and "seq32" in problem
    assert stream_problems(frame, STATE, [framed], ["source"]) == []
    assert stream_problems(frame_from_dict(FRAME, ()), (), [plain], ["source"]) == []  # stateless: nothing to reset
    with pytest.raises(ConfigError, match=r"key source\.framing: none with mqtt payload: samples"):
        SensorSource(plain, frame)


@pytest.mark.slow
@pytest.mark.idle  # mostly waits for the broker and the subscription
def test_a_payload_missing_from_an_mqtt_seq32_stream_is_counted_and_resets_the_state(tmp_path: Path) -> None:
    import paho.mqtt.client as paho

    from agent.serving.sensors import SensorSource
    from brokers import Broker

    broker = Broker(tmp_path / "broker").start()
    src = SensorSource(SourceConfig(type="mqtt", host="127.0.0.1", port=broker.port, topic="audio/mic",
                                    payload="samples", framing="seq32"), frame_from_dict(FRAME, STATE))
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    stop = threading.Event()
    frames: list[Any] = []
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                f = src.read(stop)
            except Exception as exc:  # BadFrame: the barrier payload below
                bad.append(str(exc))
                continue
            if f is None:
                return
            frames.append(f)

    threading.Thread(target=read, daemon=True).start()
    try:
        # a barrier: a retained payload without a whole sequence number and samples is refused once subscribed
        pub.publish("audio/mic", b"bad", qos=1, retain=True).wait_for_publish(30)
        assert wait_until(lambda: bad, 30), "the source never subscribed"
        for n in (0, 1, 2, 5, 6):  # 3 and 4 never delivered: 512 samples
            pub.publish("audio/mic", struct.pack("<I", n) + np.full(256, n, "<f4").tobytes(), qos=1)
        assert wait_until(lambda: len(frames) >= 5, 30), len(frames)
        assert [int(f.data[0, 0]) for f in frames] == [0, 1, 2, 5, 6]
        assert [f.span.session for f in frames] == [1, 1, 1, 2, 2]
        assert frames[3].span.reset == "512 samples lost (2 payloads missing: sequence 3 to 4)"
        h = src.streams_health()
        assert (h["lost_samples"], h["lost_payloads"], h["restarts"]) == (512, 2, 1)
    finally:
        stop.set()
        pub.loop_stop()
        pub.disconnect()
        src.close()
        broker.stop()
