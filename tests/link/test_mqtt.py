"""MQTT against real Mosquitto brokers on 127.0.0.1: availability, retained health and self-test,
predictions, commands, TLS + ACL, and no result lost while the broker (or the agent) is away."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agentproc import demo_config
from brokers import Broker, Collector, free_port, make_tls_material

DEVICE = "dev-1"
PREFIX = f"edge/{DEVICE}/"

# Skipped only outside CI: scripts/test.sh installs Debian's mosquitto, and CI must run these.
pytestmark = pytest.mark.skipif(not Path(__import__("brokers").MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed (scripts/test.sh installs it)")


@pytest.fixture
def broker(tmp_path: Path):
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


def agent_config(tmp_path: Path, port: int, **mqtt) -> dict:
    return demo_config(tmp_path, port=port, device_id=DEVICE, source={"max_fps": 40}, output={"stdout": False},
                       mqtt=mqtt)


def payloads(col: Collector, topic: str) -> list[dict]:
    return [json.loads(m.payload) for m in col.on(topic)]


def test_availability_health_selftest_predictions_then_stopped_and_offline(broker: Broker, tmp_path: Path,
                                                                          agent_process) -> None:
    col = Collector(broker.port, [PREFIX + "#"])
    agent = agent_process(agent_config(tmp_path, broker.port)).start()
    try:
        assert col.wait(lambda: len(col.on(PREFIX + "predictions")) >= 5, 60), agent.log_text()[-3000:]
        # health goes out every 0.5 s from its own timer: the last one may predate serving, so wait for one
        # that says serving (and for the retained self-test) rather than read whatever came last
        assert col.wait(lambda: any(p["serving"] for p in payloads(col, PREFIX + "health"))
                        and payloads(col, PREFIX + "selftest"), 30)
        online = payloads(col, PREFIX + "availability")[-1]
        assert online["state"] == "online" and online["session"] >= 1
        health = [p for p in payloads(col, PREFIX + "health") if p["serving"]][-1]
        assert health["serving"] is True and health["bundle"]["bundle"] == "digits-classifier"
        assert health["provider"]["effective"][0] == "CPUExecutionProvider"
        assert health["nodes_by_provider"]["CPUExecutionProvider"] > 0
        assert health["session"] == online["session"] and "rss_mb" in health["process"]
        report = payloads(col, PREFIX + "selftest")[-1]
        assert report["passed"] is True and report["selected"]["provider"] == "CPUExecutionProvider"
        pred = payloads(col, PREFIX + "predictions")[0]
        assert pred["seq"] >= 1 and pred["result"]["type"] == "classification"

        # a late subscriber gets the retained state at once
        late = Collector(broker.port, [PREFIX + "availability", PREFIX + "health", PREFIX + "selftest"])
        assert late.wait(lambda: all(late.on(PREFIX + t) for t in ("availability", "health", "selftest")), 30)
        # the first of each is the retained copy; a live health published after subscribing comes unflagged
        assert all(late.on(PREFIX + t)[0].retain for t in ("availability", "health", "selftest"))
        late.close()

        assert agent.stop() == 0
        assert col.wait(lambda: payloads(col, PREFIX + "availability")[-1]["state"] == "stopped", 30)

        agent.start()
        assert col.wait(lambda: payloads(col, PREFIX + "availability")[-1]["state"] == "online", 60)
        session = payloads(col, PREFIX + "availability")[-1]["session"]
        assert session > online["session"]
        agent.kill()
        assert col.wait(lambda: payloads(col, PREFIX + "availability")[-1]["state"] == "offline", 30)
        will = payloads(col, PREFIX + "availability")[-1]
        assert will["session"] == session  # the will names the session it belongs to
    finally:
        col.close()


def test_outbox_bound_drops_oldest_counts_it_and_drains_the_newest_in_order(broker: Broker, tmp_path: Path) -> None:
    from agent.config import MqttConfig, OutboxConfig
    from agent.link.mqtt import MqttLink
    from agent.link.outbox import Outbox

    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(max_messages=50))
    for i in range(200):  # nobody connected: all to disk, bounded
        box.put(PREFIX + "predictions", json.dumps({"seq": i}).encode(), 1)
    box.pump(lambda m: None, 10)
    assert box.depth == 50 and box.dropped == 150 and box.stats()["on_disk"] == 50
    box.close()

    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(max_messages=50))  # survives a restart
    assert box.depth == 50 and box.dropped == 150
    col = Collector(broker.port, [PREFIX + "predictions"])
    assert col.wait(lambda: col.connects >= 1, 30)
    link = MqttLink(MqttConfig(enabled=True, port=broker.port), DEVICE, tmp_path, box, lambda c: {"ok": True},
                    lambda: {}).start()
    try:
        assert col.wait(lambda: len(col.on(PREFIX + "predictions")) >= 50, 30)
        assert [p["seq"] for p in payloads(col, PREFIX + "predictions")] == list(range(150, 200))
        assert col.wait(lambda: box.depth == 0, 30)
    finally:
        link.stop()
        col.close()


def _command(port: int, name: str, payload: bytes, props: Properties | None = None, **kw) -> dict:
    col = Collector(port, [PREFIX + f"cmd/{name}/reply", PREFIX + "reply/#"], **kw)
    assert col.wait(lambda: col.connects >= 1, 30)  # subscribed (SUBACK) before the command goes out
    col.c.publish(PREFIX + f"cmd/{name}", payload, qos=1, properties=props)
    assert col.wait(lambda: col.messages, 60), f"no reply to {name}"
    msg = col.messages[0]
    col.close()
    return {"topic": msg.topic, "body": json.loads(msg.payload), "props": msg.properties}


def test_commands_reply_and_bad_ones_get_an_error(broker: Broker, tmp_path: Path, agent_process) -> None:
    col = Collector(broker.port, [PREFIX + "health"])
    agent = agent_process(agent_config(tmp_path, broker.port)).start()
    try:
        assert col.wait(lambda: any(p["serving"] for p in payloads(col, PREFIX + "health")), 60)
        r = _command(broker.port, "status", b'{"id": 7}')
        assert r["body"]["ok"] and r["body"]["id"] == 7 and r["body"]["health"]["serving"]
        r = _command(broker.port, "pause", b"{}")
        assert r["body"] == {"command": "pause", "ok": True, "paused": True}
        assert col.wait(lambda: payloads(col, PREFIX + "health")[-1]["paused"], 30)
        r = _command(broker.port, "resume", b"")
        assert r["body"]["paused"] is False
        r = _command(broker.port, "selftest", b"{}")
        assert r["body"]["ok"] and r["body"]["passed"] and r["body"]["selected"]["provider"] == "CPUExecutionProvider"
        r = _command(broker.port, "reload", b"{}")
        assert r["body"]["ok"] and r["body"]["serving"]
        r = _command(broker.port, "reboot-now", b"{}")
        assert r["body"]["ok"] is False and "unknown command 'reboot-now'" in r["body"]["error"]
        r = _command(broker.port, "status", b"{not json")
        assert r["body"]["ok"] is False and r["body"]["error"].startswith("malformed payload")
        r = _command(broker.port, "status", b"[1, 2]")
        assert r["body"]["ok"] is False and "JSON object" in r["body"]["error"]
        # MQTT 5 request/response: the reply goes to the response topic with the correlation data
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = PREFIX + "reply/op-42"
        props.CorrelationData = b"corr-1"
        r = _command(broker.port, "status", b"{}", props)
        assert r["topic"] == PREFIX + "reply/op-42" and r["props"].CorrelationData == b"corr-1"
        assert agent.returncode is None  # nothing crashed
    finally:
        agent.stop()
        col.close()


def test_broker_down_at_boot_does_not_stop_serving_and_results_arrive_later(tmp_path: Path, agent_process) -> None:
    # A persistent subscriber registered on this broker and saved (a graceful stop writes the session), so
    # the results the agent drains the moment the broker comes up are queued for it even if it reconnects
    # after the agent does; a subscriber that connected after the agent could miss seq 1 for good.
    broker = Broker(tmp_path / "broker").start()
    sub = Collector(broker.port, [PREFIX + "predictions"], client_id="late-recorder", persistent=True)
    assert sub.wait(lambda: sub.connects >= 1, 30)
    broker.stop()
    cfg = agent_config(tmp_path, broker.port)
    cfg["output"]["stdout"] = True
    agent = agent_process(cfg, log_args=("--log-level", "warning")).start()
    try:
        assert all(r["seq"] for r in agent.wait_results(10))  # serving with no broker at all
        broker.start()
        assert sub.wait(lambda: any(p["seq"] == 1 for p in payloads(sub, PREFIX + "predictions")), 60)
    finally:
        sub.close()
        agent.stop()
        broker.stop()


@pytest.fixture(scope="module")
def tls_material(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def test_tls_with_password_and_acl(tls_material: dict, tmp_path: Path, agent_process) -> None:
    broker = Broker(tmp_path / "broker", tls_port=free_port(), tls=tls_material).start()
    secret = tmp_path / "agent.pass"
    secret.write_text("agent-secret\n")
    cfg = agent_config(tmp_path, broker.tls_port, username="agent", password_file=str(secret),
                       tls={"ca_file": str(tls_material["ca"])})
    agent = agent_process(cfg).start()
    common = dict(tls=tls_material, tls_port=broker.tls_port)
    try:
        op = Collector(broker.port, [PREFIX + "#"], username="operator", password="operator-secret", **common)
        assert op.wait(lambda: payloads(op, PREFIX + "predictions"), 60), agent.log_text()[-2000:]
        assert "agent-secret" not in agent.log_text()  # secrets are never logged
        r = _command(broker.port, "status", b"{}", username="operator", password="operator-secret", **common)
        assert r["body"]["ok"]
        # a client without ACL rights to publish commands gets no command through. The broker drops the
        # viewer's connection on the refused publish, so the replies are watched by a second, read-only client
        watch = Collector(broker.port, [PREFIX + "cmd/status/reply"], username="viewer", password="viewer-secret",
                          **common)
        viewer = Collector(broker.port, [], username="viewer", password="viewer-secret", **common)
        assert watch.wait(lambda: watch.connects >= 1 and viewer.connects >= 1, 30)
        viewer.c.publish(PREFIX + "cmd/status", b'{"id": "viewer"}', qos=1).wait_for_publish(5)
        # barrier: an operator's command sent after it is answered; the agent answers in order, so the
        # viewer's command, had it got through, would have been answered first
        after = _command(broker.port, "status", b'{"id": "after"}', username="operator", password="operator-secret",
                         **common)
        assert after["body"]["id"] == "after"
        ids = lambda: [json.loads(m.payload).get("id") for m in watch.on(PREFIX + "cmd/status/reply")]  # noqa: E731
        assert watch.wait(lambda: "after" in ids(), 30), ids()
        assert ids() == ["after"]
        viewer.close()
        watch.close()
        # a wrong password is refused
        bad = Collector(broker.port, [], username="operator", password="wrong", **common)
        assert bad.wait(lambda: bad.last_reason is not None, 30)
        assert bad.last_reason.is_failure and bad.connects == 0
        bad.close()
        op.close()
    finally:
        agent.stop()
        broker.stop()


def test_monitor_lists_devices_and_flags_stale_health(broker: Broker, tmp_path: Path, agent_process) -> None:
    # Stale means health older than 3 intervals: at the demo's 0.5 s an agent starved of CPU for 1.5 s
    # on a loaded machine would read stale; 5 s leaves the ghost (600 s old) stale and the live one not.
    cfg = agent_config(tmp_path, broker.port)
    cfg["output"]["health_interval_s"] = 5
    agent = agent_process(cfg).start()
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    # a device that says online but whose last health is long past: stale
    pub.publish("edge/ghost/availability", json.dumps({"state": "online", "session": 3}), qos=1, retain=True)
    pub.publish("edge/ghost/health", json.dumps({"ts": time.time() - 600, "interval_s": 10, "serving": True,
                                                  "session": 3}), qos=1, retain=True).wait_for_publish(5)
    try:
        col = Collector(broker.port, [PREFIX + "health"])
        assert col.wait(lambda: any(p["serving"] for p in payloads(col, PREFIX + "health")), 60)
        col.close()
        out = subprocess.run([sys.executable, "-m", "agent", "monitor", "--broker", f"127.0.0.1:{broker.port}",
                              "--once", "--wait", "2", "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = {r["device"]: r for r in json.loads(out.stdout)}
        assert rows[DEVICE]["availability"] == "online" and not rows[DEVICE]["stale"]
        assert rows[DEVICE]["bundle"] == "digits-classifier@1" and rows[DEVICE]["provider"] == "CPUExecutionProvider"
        assert rows[DEVICE]["verdict"] == "pass"
        assert rows["ghost"]["stale"] is True
        table = subprocess.run([sys.executable, "-m", "agent", "monitor", "--broker", f"127.0.0.1:{broker.port}",
                                "--once", "--wait", "2"], capture_output=True, text=True, timeout=60).stdout
        assert DEVICE in table and "STALE" in table
    finally:
        pub.loop_stop()
        agent.stop()


def test_mqtt_311_and_home_assistant_discovery_reannounced_on_ha_restart(broker: Broker, tmp_path: Path,
                                                                         agent_process) -> None:
    col = Collector(broker.port, ["homeassistant/#", PREFIX + "predictions"])
    agent = agent_process(agent_config(tmp_path, broker.port, protocol="3.1.1", homeassistant=True)).start()
    try:
        configs = lambda: [m for m in col.messages if m.topic.endswith("/config")]  # noqa: E731
        assert col.wait(lambda: len(configs()) >= 5 and col.on(PREFIX + "predictions"), 60)
        doc = json.loads(configs()[0].payload)
        assert doc["device"]["identifiers"] == [f"edge-agent-{DEVICE}"]
        assert {json.loads(m.payload)["unique_id"] for m in configs()} >= {
            f"edge_agent_{DEVICE}_{k}" for k in ("fps", "latency_p95", "provider", "verdict", "last_prediction")}
        before = len(configs())
        pub = paho.Client(paho.CallbackAPIVersion.VERSION2)
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        pub.publish("homeassistant/status", b"online", qos=1).wait_for_publish(5)
        assert col.wait(lambda: len(configs()) >= before + 5, 30)
        pub.loop_stop()
    finally:
        agent.stop()
        col.close()


def test_unreachable_broker_is_a_structured_event_and_the_log_stays_json(tmp_path: Path, agent_process) -> None:
    agent = agent_process(agent_config(tmp_path, free_port())).start()  # nothing listens: refused, again and again
    agent.wait_event("mqtt.connect_failed", timeout=60)
    agent.stop()
    bad = [ln for ln in agent.log_text().splitlines() if ln.strip() and not ln.startswith("{")]
    assert bad == [], bad[:5]
