"""A connection whose setup fails half-way is dropped and made again, never left connected but mute.

Fault (issue 20): `on_connect` raised ENOSPC (the session counter) before it subscribed: the agent stayed
connected, subscribed to nothing, with no prediction, health or reply for as long as the broker stayed up.
Here the link's state directory is a real full filesystem for the first connect, then one setup step fails
outright once: both times the link ends up subscribed and answering, on a real Mosquitto."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.config import MqttConfig
from agent.link.mqtt import MqttLink
from agent.link.outbox import Outbox
from brokers import MOSQUITTO, Broker, Collector
from full_disk import fill, small_disk  # noqa: F401

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed")


def _link(port: int, state: Path) -> MqttLink:
    cfg = MqttConfig(enabled=True, port=port, keepalive=5, reconnect_min_s=1, reconnect_max_s=1)
    return MqttLink(cfg, "dev-cs", state, Outbox(state / "outbox.sqlite"), lambda cmd: {"ok": True, "pong": cmd.name},
                    lambda: {})


def _answers(col: Collector, link: MqttLink, tag: str) -> bool:
    assert col.wait(lambda: col.connects >= 1, 30)  # subscribed (SUBACK) before the command goes out
    # `connected` is set inside on_connect, before paho has sent the SUBSCRIBE: a command sent at once may
    # reach the broker first and go nowhere. Sent again every 2 s: a mute link never answers any of them.
    for _ in range(10):
        col.c.publish("edge/dev-cs/cmd/status", json.dumps({"id": tag}), qos=1)
        if col.wait(lambda: any(json.loads(m.payload).get("id") == tag
                                for m in col.on("edge/dev-cs/cmd/status/reply")), 2):
            return True
    return False


def test_a_connect_on_a_full_disk_still_subscribes(tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, ["edge/dev-cs/#"])
    link = _link(broker.port, small_disk)
    fill(small_disk)  # the session counter cannot be written
    try:
        link.start()
        assert link.connected.wait(30)
        assert _answers(col, link, "full"), "connected but mute on a full disk"
        assert link.session >= 1
    finally:
        link.stop(drain_s=0)
        col.close()
        broker.stop()


def test_a_failed_connection_setup_drops_the_connection_and_the_retry_subscribes(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, ["edge/dev-cs/#"])
    link = _link(broker.port, tmp_path / "state")
    real, calls = link._session_up, []

    def once_broken(client):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")  # the step that failed in the field
        return real(client)

    link._session_up = once_broken  # type: ignore[method-assign]
    try:
        link.start()
        assert link.connected.wait(60), "never connected after a failed setup"
        assert len(calls) >= 2  # the first connection was dropped, paho connected again
        assert _answers(col, link, "retried")
    finally:
        link.stop(drain_s=0)
        col.close()
        broker.stop()
