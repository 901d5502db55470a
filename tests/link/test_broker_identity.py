"""The shipped broker config ties a client id to its user name: a device with valid credentials that
connects under another device's client id (the default `edge-agent-<device_id>` is predictable) must not
knock that device off the broker, nor make the broker publish its `offline` last will.

Fault (issue 20): with the README's ACL alone, dev-a's account with client id `edge-agent-dev-b`
disconnected dev-b 11 times in 10 connects, publishing dev-b's `offline` will each time."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from brokers import MOSQUITTO, Broker, Collector, free_port, wait_port
from tests.link.test_broker_acl import ACL, USERS, AclBroker, device_b
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
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


class ShippedListenersBroker(Broker):
    """The shipped config itself, its listeners on 127.0.0.1 without TLS: each listener's identity settings,
    password file (devices and viewer in one, operators in the other) and ACL as shipped."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.tools_port = free_port()

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        files = {"/etc/mosquitto/passwd": {u: p for u, p in USERS.items() if u != "operator"},
                 "/etc/mosquitto/passwd-operators": {"operator": USERS["operator"]}}
        local = {}
        for shipped, users in files.items():
            path = self.workdir / Path(shipped).name
            for i, (user, pw) in enumerate(users.items()):
                subprocess.run(["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(path), user, pw],
                               check=True, capture_output=True)
            local[shipped] = path
        ports = iter([self.port, self.tools_port])
        lines = [*(["user root"] if os.geteuid() == 0 else []), "log_dest stderr", "log_type error"]
        for line in (ln.strip() for ln in SHIPPED.read_text().splitlines()):
            key, _, value = line.partition(" ")
            if not line or line.startswith("#") or key in ("cafile", "certfile", "keyfile"):
                continue
            if key == "listener":
                line = f"listener {next(ports)} 127.0.0.1"
            elif key == "password_file":
                line = f"password_file {local[value]}"
            elif key == "acl_file":
                line = f"acl_file {ACL}"
            lines.append(line)
        conf = self.workdir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf


def _tool(port: int) -> Collector:
    """A tool of the operator's account as push and monitor make it: MQTT 5, no client id of its own."""
    return Collector(port, ["edge/dev-a/#"], username="operator", password=USERS["operator"])


def test_two_tools_of_one_account_run_side_by_side_on_the_shipped_tools_listener(tmp_path: Path) -> None:
    """Fault: under use_username_as_clientid every client of the operator account was "operator": `push`
    died with "The client is not currently connected" while a `monitor` ran, each knocking the other off."""
    broker = ShippedListenersBroker(tmp_path / "broker").start()
    wait_port(broker.tools_port, 30)
    push, monitor = _tool(broker.tools_port), _tool(broker.tools_port)
    try:
        assert push.wait(lambda: push.connects >= 1, 30) and monitor.wait(lambda: monitor.connects >= 1, 30)
        for i in range(3):  # round trips on both, each seen by the other: both stay connected throughout
            for sender, other in ((push, monitor), (monitor, push)):
                sender.c.publish(f"edge/dev-a/cmd/ping{i}", b"{}", qos=1).wait_for_publish(5)
                assert other.wait(lambda: other.on(f"edge/dev-a/cmd/ping{i}"), 30)
        assert (push.connects, monitor.connects) == (1, 1), "a tool was knocked off and reconnected"
        # a device cannot log in on the tools listener (and so cannot pick another device's client id there)
        rogue = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="dev-b", protocol=paho.MQTTv5)
        rogue.username_pw_set("dev-a", USERS["dev-a"])
        refused: list[str] = []
        rogue.on_connect = lambda c, u, f, rc, p: refused.append(str(rc))
        rogue.connect("127.0.0.1", broker.tools_port, 10)
        rogue.loop_start()
        try:
            assert wait_until(lambda: bool(refused), 10) and refused[0] != "Success", refused
        finally:
            rogue.loop_stop()
    finally:
        push.close()
        monitor.close()
        broker.stop()
