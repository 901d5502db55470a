"""A SIGHUP (reload) during an update's probation: the reload waits for the verdict (it would re-read the
store and swap the engine under the probation), then runs, and the committed bundle serves after it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.updates.test_updates import kit, preds, push_v2_until, serving_v1, serving_version, statuses  # noqa: F401


@pytest.mark.slow
def test_a_reload_during_probation_waits_for_the_verdict_then_runs(tmp_path: Path, kit: dict,  # noqa: F811
                                                                  agent_process) -> None:
    with serving_v1(tmp_path, kit, agent_process, probation_s=4.0, probation_frames=100000) as (broker, col, agent):
        push_v2_until(col, kit, broker.port, lambda s: s.get("phase") == "probation")
        agent.signal(signal.SIGHUP)
        assert col.wait(lambda: any(s["state"] == "committed" for s in statuses(col)), 90), \
            [(s["state"], s.get("reason")) for s in statuses(col)]
        agent.wait_event("reload.start", timeout=60)  # the deferred reload ran
        assert agent.events("reload.deferred"), "the reload was not deferred behind the update"
        assert agent.positions("reload.start")[0] > agent.positions("update.committed")[0], \
            "the reload ran inside probation"
        n = len(preds(col))
        assert col.wait(lambda: len(preds(col)) > n + 10 and serving_version(col) == 2, 90)
        store = tmp_path / "state" / "store"
        assert os.readlink(store / "current") == os.readlink(store / "committed")
        assert "-v2-" in os.readlink(store / "committed")
        assert agent.returncode is None
