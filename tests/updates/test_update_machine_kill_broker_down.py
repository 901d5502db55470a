"""SIGKILL in probation while the broker is down, and the agent boots with the broker still down: the store
is consistent at once (current == committed, the uncommitted v2 pruned), and when the broker returns the
interrupted update's verdict (rolled_back) is there, retained, and v1 serves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from brokers import Broker, Collector
from tests.updates.test_updates import PREFIX, agent_config, kit, preds, push_v2_until, serving_version, statuses  # noqa: F401


@pytest.mark.slow
def test_a_kill_in_probation_with_the_broker_down_boots_consistent_and_reports_when_it_returns(
        tmp_path: Path, kit: dict, agent_process) -> None:  # noqa: F811
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    cfg = agent_config(tmp_path, kit, broker.port, probation_s=60.0, probation_frames=100000)
    agent = agent_process(cfg).start()
    col2: Collector | None = None
    try:
        assert col.wait(lambda: len(preds(col)) >= 5, 90), agent.log_text()[-3000:]
        update = push_v2_until(col, kit, broker.port, lambda s: s.get("phase") == "probation")["update"]
        col.close()
        broker.stop()
        agent.kill()  # power cut in probation, the broker away
        store = tmp_path / "state" / "store"
        assert json.loads((store / "update.json").read_text())["state"] == "probation"
        agent.start()
        agent.wait_event("update.interrupted", timeout=90)
        assert os.readlink(store / "current") == os.readlink(store / "committed")
        assert all("-v2-" not in p.name for p in (store / "bundles").iterdir())
        broker.start()
        col2 = Collector(broker.port, [PREFIX + "#"])
        assert col2.wait(lambda: any(s["update"] == update and s["state"] == "rolled_back" for s in statuses(col2)), 90), \
            [(s["update"], s["state"]) for s in statuses(col2)]
        assert col2.wait(lambda: len(preds(col2)) >= 5, 90)
        assert serving_version(col2) == 1 and preds(col2)[-1]["boot"] == 2
    finally:
        agent.stop()
        if col2 is not None:
            col2.close()
        broker.stop()
