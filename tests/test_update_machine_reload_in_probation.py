"""A SIGHUP (reload) during an update's probation: the reload waits for the verdict (it would re-read the
store and swap the engine under the probation), then runs, and the committed bundle serves after it."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from brokers import Broker, Collector
from test_updates import AgentProc, _quiet, agent_config, kit, preds, send_archive, serving_version, statuses  # noqa: F401
from waiting import wait_until


def _events(log: Path, name: str) -> list[int]:
    """Line numbers of a JSON event in the agent's log, in order."""
    out = []
    for i, line in enumerate(log.read_text().splitlines()):
        if line.startswith("{") and f'"{name}"' in line and json.loads(line).get("event") == name:
            out.append(i)
    return out


@pytest.mark.slow
def test_a_reload_during_probation_waits_for_the_verdict_then_runs(tmp_path: Path, kit: dict) -> None:  # noqa: F811
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, ["edge/dev-u/#"])
    cfg = agent_config(tmp_path, kit, broker.port, probation_s=4.0, probation_frames=100000)
    log = tmp_path / "agent.log"
    agent = AgentProc(cfg, log).start()
    try:
        assert col.wait(lambda: len(preds(col)) >= 5, 90), log.read_text()[-3000:]
        threading.Thread(target=lambda: _quiet(send_archive, kit["bundles"]["v2"], broker.port), daemon=True).start()
        assert col.wait(lambda: any(s.get("phase") == "probation" for s in statuses(col)), 90)
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGHUP)
        assert col.wait(lambda: any(s["state"] == "committed" for s in statuses(col)), 90), \
            [(s["state"], s.get("reason")) for s in statuses(col)]
        assert wait_until(lambda: _events(log, "reload.start"), 60), "the deferred reload never ran"
        assert _events(log, "reload.deferred"), "the reload was not deferred behind the update"
        assert _events(log, "reload.start")[0] > _events(log, "update.committed")[0], "the reload ran inside probation"
        n = len(preds(col))
        assert col.wait(lambda: len(preds(col)) > n + 10 and serving_version(col) == 2, 90)
        store = tmp_path / "state" / "store"
        assert os.readlink(store / "current") == os.readlink(store / "committed")
        assert "-v2-" in os.readlink(store / "committed")
        assert agent.proc.poll() is None
    finally:
        agent.stop()
        col.close()
        broker.stop()
