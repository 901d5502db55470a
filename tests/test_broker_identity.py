"""The shipped broker config ties a client id to its user name: a device with valid credentials that
connects under another device's client id (the default `edge-agent-<device_id>` is predictable) must not
knock that device off the broker, nor make the broker publish its `offline` last will.

Fault (issue 20): with the README's ACL alone, dev-a's account with client id `edge-agent-dev-b`
disconnected dev-b 11 times in 10 connects, publishing dev-b's `offline` will each time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from brokers import MOSQUITTO, Collector
from test_broker_acl import USERS, AclBroker, device_b

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "mosquitto" / "mosquitto.conf"
IDENTITY_KEYS = ("use_username_as_clientid", "use_identity_as_username")

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed (scripts/test.sh installs it)")


def shipped_identity_lines() -> list[str]:
    """The identity settings of the shipped example (its listener, certificates and paths stay out)."""
    return [line.strip() for line in SHIPPED.read_text().splitlines() if line.strip().startswith(IDENTITY_KEYS)]


class ShippedIdentityBroker(AclBroker):
    def write_config(self) -> Path:
        conf = super().write_config()
        conf.write_text(conf.read_text() + "\n".join(shipped_identity_lines()) + "\n")
        return conf


def test_shipped_config_ties_the_client_id_to_the_user_name() -> None:
    assert "use_username_as_clientid true" in shipped_identity_lines()


def test_a_device_cannot_take_over_another_devices_client_id(tmp_path: Path) -> None:
    broker = ShippedIdentityBroker(tmp_path / "broker").start()
    agent = device_b(tmp_path, broker.port)
    operator = Collector(broker.port, ["edge/dev-b/#"], username="operator", password=USERS["operator"])
    avail = lambda: [json.loads(m.payload) for m in operator.on("edge/dev-b/availability")]  # noqa: E731
    try:
        assert operator.wait(lambda: any(a["state"] == "online" for a in avail()), 90), \
            agent.log_text()[-2000:]
        before = avail()[-1]["session"]
        for i in range(10):  # dev-a's valid account under dev-b's predictable client id
            rogue = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="edge-agent-dev-b", protocol=paho.MQTTv5)
            rogue.username_pw_set("dev-a", USERS["dev-a"])
            rogue.connect("127.0.0.1", broker.port, 10)
            rogue.loop_start()
            deadline = time.monotonic() + 5
            while not rogue.is_connected() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rogue.is_connected(), f"connect {i}: dev-a's own account was refused"
            rogue.disconnect()
            rogue.loop_stop()
        # barrier: a command round trip after the last takeover attempt (an operator's status command)
        operator.c.publish("edge/dev-b/cmd/status", b'{"id": "after"}', qos=1).wait_for_publish(5)
        assert operator.wait(lambda: operator.on("edge/dev-b/cmd/status/reply"), 30), "dev-b stopped answering"
        states = [(a["state"], a["session"]) for a in avail()]
        assert all(s != "offline" for s, _ in states), states
        assert avail()[-1]["session"] == before, f"dev-b reconnected: {states}"
    finally:
        agent.stop()
        operator.close()
        broker.stop()
