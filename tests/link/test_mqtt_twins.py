"""Two live agents with one `device_id` (a cloned SD card, a copied config): both connected as
`edge-agent-<id>`, the broker knocked each off in turn, availability flapped, and both emitted `boot 1,
seq 1..` so a consumer de-duplicating by (boot, seq) merged or dropped results; neither said why. Now each
agent process draws an instance id (in availability, health and every result) and both say loudly that a
twin is there (a real broker, two real agents)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentproc import demo_config
from brokers import MOSQUITTO, Broker, Collector

DEVICE = "twin"
PREFIX = f"edge/{DEVICE}/"

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed (scripts/test.sh installs it)")


def test_two_agents_with_one_device_id_are_both_told_and_their_results_stay_distinguishable(
        tmp_path: Path, agent_process) -> None:
    broker = Broker(tmp_path / "broker").start()
    sub = Collector(broker.port, [PREFIX + "predictions"])
    agents = [agent_process(demo_config(tmp_path / name, port=broker.port, device_id=DEVICE, source={"max_fps": 20}),
                            name=name).start() for name in ("a", "b")]
    try:
        for agent in agents:  # both are told, whichever connected first
            said = agent.wait_event("mqtt.twin_detected", timeout=120)
            assert said["device_id"] == DEVICE and "device_id" in said["reason"]
        instances = [{r["instance"] for r in agent.wait_results(5, 120)} for agent in agents]
        assert all(len(i) == 1 for i in instances) and instances[0] != instances[1], instances
        # what a consumer sees: (instance, boot, seq) names one result, although (boot, seq) repeats. QoS 1 may
        # deliver a result twice (the twins knock each other off before a PUBACK): the same result again is
        # at-least-once, two different results under one key would be the fault
        got = [json.loads(m.payload) for m in sub.on(PREFIX + "predictions")]
        by_key: dict[tuple, set[str]] = {}
        for r in got:
            by_key.setdefault((r["instance"], r["boot"], r["seq"]), set()).add(json.dumps(r, sort_keys=True))
        assert all(len(v) == 1 for v in by_key.values()), [k for k, v in by_key.items() if len(v) > 1]
        for agent in agents:
            assert agent.stop() == 0
    finally:
        for agent in agents:
            agent.kill()
        sub.close()
        broker.stop()
