"""`push` to a mistyped device fails fast (issue 18): it checks the device's retained availability first instead
of waiting the whole --timeout (600 s) in silence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as paho

from brokers import Broker

ROOT = Path(__file__).resolve().parents[2]


def _push(broker: Broker, device: str, archive: Path, *extra: str) -> subprocess.CompletedProcess:
    # subprocess timeout 120 s against --timeout 600: a push that waits for a verdict fails this test
    return subprocess.run([sys.executable, "-m", "agent", "push", "--device", device, "--bundle", str(archive),
                           "--broker", f"127.0.0.1:{broker.port}", *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _retain(broker: Broker, topic: str, doc: dict) -> None:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    c.publish(topic, json.dumps(doc), qos=1, retain=True).wait_for_publish(10)
    c.disconnect()  # before loop_stop: no 1 s wait for paho's select
    c.loop_stop()


def test_push_to_a_device_the_broker_never_saw_fails_fast_naming_the_topic(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        archive = tmp_path / "b.tar.gz"
        archive.write_bytes(b"not even an archive")
        out = _push(broker, "cam-l", archive)
    finally:
        broker.stop()
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("edge-agent: ")]
    assert lines == [f"edge-agent: no device 'cam-l' on the broker 127.0.0.1:{broker.port}: nothing retained on "
                     "edge/cam-l/availability; check --device (and --prefix); `edge-agent monitor --once` lists the "
                     "devices the broker knows"], out.stderr


def test_push_to_a_known_but_offline_device_warns_and_waits_for_its_verdict(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        _retain(broker, "edge/cam-1/availability", {"state": "offline", "session": 3})
        archive = tmp_path / "b.tar.gz"
        archive.write_bytes(b"not even an archive")
        out = _push(broker, "cam-1", archive, "--timeout", "2")
    finally:
        broker.stop()
    assert out.returncode == 1
    assert "warning: cam-1 is offline: the push waits for it to come back" in out.stderr
    assert "no verdict from cam-1 within 2 s" in out.stderr  # past the availability check: it did wait
