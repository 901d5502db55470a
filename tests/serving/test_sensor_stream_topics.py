"""Each UDP sender's results on its own MQTT topic, predictions/<stream> (issue 22: per-stream topics).

A real agent process serving a sensor bundle from one UDP source, a real Mosquitto broker, two real
senders: each sender's windows land on predictions/<source>/<host>:<port>, none on the shared topic
(before: every stream's results went to predictions, told apart only inside the payload).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from brokers import MOSQUITTO, free_port
from waiting import wait_until
from agentproc import demo_config

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow,  # a real agent process and a real broker: about 10 s
              pytest.mark.skipif(not Path(MOSQUITTO).exists(), reason="mosquitto is not installed")]


def test_each_udp_sender_publishes_on_its_own_predictions_topic(tiny_sensor_bundle: Path, tmp_path: Path,
                                                               agent_process) -> None:
    from brokers import Broker, Collector

    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, ["edge/dev-s/#"])
    port = free_port()
    senders = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        cfg = demo_config(tmp_path, port=broker.port, device_id="dev-s", bundle=str(tiny_sensor_bundle),
                          output={"health_interval_s": 0.3, "stdout": False})
        cfg["source"] = {"type": "udp", "host": "127.0.0.1", "port": port}
        agent_process(cfg).start()
        assert col.wait(lambda: col.on("edge/dev-s/health"), 90), "the agent never published health"
        for s in senders:
            s.bind(("127.0.0.1", 0))
        topics = {f"edge/dev-s/predictions/udp:127.0.0.1:{port}/127.0.0.1:{s.getsockname()[1]}": s for s in senders}
        window = np.random.default_rng(3).normal(0, 1, (64, 3)).astype("<f4").tobytes()

        def served() -> bool:  # keep sending (UDP before the socket binds is lost) until both topics hold 3
            for s in senders:
                s.sendto(window, ("127.0.0.1", port))
            return all(len(col.on(t)) >= 3 for t in topics)

        assert wait_until(served, 60, interval=0.1), {t: len(col.on(t)) for t in topics}
        for t, s in topics.items():
            got = [json.loads(m.payload) for m in col.on(t)]
            name = t[len("edge/dev-s/predictions/"):]
            assert {r["source"] for r in got} == {name}
            assert {r["result"]["stream"]["sender"] for r in got} == {f"127.0.0.1:{s.getsockname()[1]}"}
        assert not col.on("edge/dev-s/predictions")
    finally:
        for s in senders:
            s.close()
        col.close()
        broker.stop()
