"""SIGKILL in probation while the broker is down, and the agent boots with the broker still down: the store
is consistent at once (current == committed, the uncommitted v2 pruned), and when the broker returns the
interrupted update's verdict (rolled_back) is there, retained, and v1 serves."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from brokers import Broker, Collector
from test_updates import PREFIX, AgentProc, _quiet, agent_config, kit, preds, send_archive, serving_version, statuses  # noqa: F401
from waiting import wait_until


@pytest.mark.slow
def test_a_kill_in_probation_with_the_broker_down_boots_consistent_and_reports_when_it_returns(
        tmp_path: Path, kit: dict) -> None:  # noqa: F811
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    cfg = agent_config(tmp_path, kit, broker.port, probation_s=60.0, probation_frames=100000)
    log = tmp_path / "agent.log"
    agent = AgentProc(cfg, log).start()
    col2: Collector | None = None
    try:
        assert col.wait(lambda: len(preds(col)) >= 5, 90), log.read_text()[-3000:]
        threading.Thread(target=lambda: _quiet(send_archive, kit["bundles"]["v2"], broker.port), daemon=True).start()
        assert col.wait(lambda: any(s.get("phase") == "probation" for s in statuses(col)), 90)
        update = [s for s in statuses(col) if s.get("phase") == "probation"][-1]["update"]
        col.close()
        broker.stop()
        agent.kill()  # power cut in probation, the broker away
        store = tmp_path / "state" / "store"
        assert json.loads((store / "update.json").read_text())["state"] == "probation"
        agent = AgentProc(cfg, log).start()
        assert wait_until(lambda: '"update.interrupted"' in log.read_text(), 90), log.read_text()[-3000:]
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
