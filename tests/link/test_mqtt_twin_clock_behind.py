"""Review of issue 43 point 3 ("one device, one identity": detect a second live agent): a device without a
real-time clock (a Raspberry Pi: fake-hwclock restores the last hourly save, or no restore at all) starts its agent
before NTP steps the clock (the shipped unit orders after network-online.target, not time-sync.target). The
previous process's retained availability on the device's own topic then carries a `ts` ahead of this process's
`started_ts`, and `MqttLink._on_availability` (`written >= self.started_ts`) takes it for a second live agent:
`mqtt.twin_detected` (error) and health `identity.twin` on a device that has no twin.

Simulated with the broker's retained message: the previous process's `offline` will, written by the device's
own earlier process whose clock was 10 minutes ahead of this boot's (no other agent runs here).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from agentproc import demo_config
from brokers import Broker

DEVICE = "dev-r43b-rtc"


@pytest.mark.slow
def test_a_restart_with_the_clock_behind_is_not_a_twin(tmp_path: Path, agent_process) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="r43b-prev", protocol=paho.MQTTv5)
        pub.connect("127.0.0.1", broker.port, 10)
        pub.loop_start()
        # what the device's previous process left: its last will, stamped by a clock 600 s ahead of this boot's
        prev = {"state": "offline", "session": 7, "ts": round(time.time() + 600, 3), "instance": "0123456789ab"}
        pub.publish(f"edge/{DEVICE}/availability", json.dumps(prev), qos=1, retain=True).wait_for_publish(10)
        pub.loop_stop()
        pub.disconnect()
        agent = agent_process(demo_config(tmp_path, port=broker.port, device_id=DEVICE,
                                          source={"max_fps": 20})).start()
        try:
            agent.wait_results(20, timeout=180)
            time.sleep(3.0)
            twins = agent.events("mqtt.twin_detected")
        finally:
            agent.stop(60)
    finally:
        broker.stop()
    assert twins == [], f"a twin said with no second agent: {str(twins[0])[:600]}"
