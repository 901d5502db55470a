"""Review of issue 44 (third pass): MQTT `payload: samples`, `framing: seq32`, with a real Mosquitto.

A lost connection is one hole (docs/sensors.md: 'a lost connection is a hole ... the next window is a new session');
payloads published while the agent was away are its samples, counted once. Issue 44: every loss counted, not
counted twice.
"""

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

W = 256
STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=30.0),)
FRAME = {"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": W}


@pytest.mark.slow
@pytest.mark.idle
def test_a_lost_mqtt_connection_is_one_hole_counted_once(tmp_path: Path) -> None:
    import paho.mqtt.client as paho

    from agent.serving.sensors import SensorSource
    from brokers import Broker

    broker = Broker(tmp_path / "broker").start()
    src = SensorSource(SourceConfig(type="mqtt", host="127.0.0.1", port=broker.port, topic="audio/mic",
                                    payload="samples", framing="seq32"), frame_from_dict(FRAME, STATE))
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2)
    pub.reconnect_delay_set(1, 2)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    stop = threading.Event()
    frames: list[Any] = []
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                f = src.read(stop)
            except Exception as exc:  # BadFrame: the barrier payloads
                bad.append(str(exc))
                continue
            if f is None:
                return
            frames.append(f)

    threading.Thread(target=read, daemon=True).start()
    send = lambda n: pub.publish("audio/mic", struct.pack("<I", n) + np.full(W, n, "<f4").tobytes(), qos=1)  # noqa: E731
    try:
        pub.publish("audio/mic", b"bad", qos=1, retain=True).wait_for_publish(30)
        assert wait_until(lambda: bad, 30), "the source never subscribed"
        for n in range(4):
            send(n)
        assert wait_until(lambda: len(frames) >= 4, 30), len(frames)
        broker.stop()  # the agent's connection is lost; numbers 4 and 5 are published meanwhile (never delivered)
        broker.start()
        assert wait_until(lambda: len(bad) >= 2 and pub.is_connected(), 60), "the source never subscribed again"
        for n in range(6, 10):
            send(n)
        assert wait_until(lambda: len(frames) >= 8, 30), len(frames)
        h = src.streams_health()
        after = frames[4:]
        assert [int(f.data[0, 0]) for f in after] == [6, 7, 8, 9]
        assert after[0].span.session == 2 and after[0].span.reset
        assert h["lost_samples"] == 2 * W and h["lost_payloads"] == 2
        assert h["restarts"] == 1, (f"one lost connection (2 payloads missed): restarts {h['restarts']}, sessions "
                                    f"{[f.span.session for f in frames]}, reset said {after[0].span.reset!r}")
    finally:
        stop.set()
        pub.loop_stop()
        pub.disconnect()
        src.close()
        broker.stop()
