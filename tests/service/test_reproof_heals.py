"""Transient failures heal: a device too slow only because of a passing load proves again while up,
on a backoff schedule, and serves as soon as a proof passes, without a restart."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.service.reproof import Reproof, ReproofSchedule
from agent.testing import rewrite_manifest
from agentproc import DEMO_BUNDLE as DIGITS
from agentproc import DEMO_FRAMES as FRAMES
from agentproc import demo_config


def test_schedule_backs_off_doubling_capped_and_stops_once_serving() -> None:
    now = [100.0]
    r = Reproof(ReproofSchedule(10.0, 35.0), clock=lambda: now[0])
    too_slow = {"passed": False, "too_slow": True}
    r.after_proof(too_slow, serving=False, reason="no candidate passed: latency")
    assert r.armed and r.to_dict()["next_attempt_in_s"] == 10.0 and not r.due()
    waits = []
    for _ in range(4):
        now[0] = r.next_at
        assert r.due()
        r.started()
        waits.append(r.schedule.delay(r.attempts))
        r.after_proof(too_slow, serving=False, reason="still slow")
    assert waits == [10.0, 20.0, 35.0, 35.0] and r.attempts == 4
    assert r.to_dict()["schedule_s"][:4] == [10.0, 20.0, 35.0, 35.0]
    r.after_proof({"passed": True}, serving=True, reason=None)
    assert not r.armed and not r.due() and r.to_dict()["healed"] == 1
    # a refusal a quieter machine cannot clear (wrong answers) is not re-proven
    r.after_proof({"passed": False, "too_slow": False}, serving=False, reason="fidelity")
    assert not r.armed
    assert not Reproof(ReproofSchedule(0.0)).schedule.enabled


@pytest.mark.slow
@pytest.mark.serial  # it makes the load itself and judges latency
def test_latency_only_failure_under_load_serves_once_the_load_stops_without_a_restart(tmp_path: Path,
                                                                                      agent_process) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DIGITS, bundle)
    rewrite_manifest(bundle, lambda d: d["selftest"].update(latency_budget_ms={"default": 12.0}))
    # The load: two busy loops, and (so that the verdict does not depend on how busy this shared machine
    # is) a slow-down of 30 ms per timed run while the flag file exists; both stop together.
    flag = tmp_path / "loaded"
    flag.touch()
    cfg = demo_config(tmp_path, loop=False, bundle=str(bundle),
                      selection={"use_cache": False, "latency_retries": 0, "reproof_backoff_s": 2.0,
                                 "reproof_max_backoff_s": 4.0})
    fault = ";".join(f"slow:CPUExecutionProvider:{v}={flag}" for v in ("fp32", "int8"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": fault}).start()
    try:
        # proven again while up, and refused again while the load lasts
        agent.wait_event("boot.not_serving", timeout=180, count=2)
        scheduled = agent.events("reproof.scheduled")
        assert scheduled[0]["next_attempt_in_s"] == 2.0 and scheduled[0]["schedule_s"][:3] == [2.0, 4.0, 4.0]
        assert any(e.get("reproof", {}).get("armed") for e in agent.events("health"))
    finally:
        flag.unlink()
        for b in busy:
            b.send_signal(signal.SIGKILL)
            b.wait()
    stopped = len(agent.events("reproof.start"))
    # the next scheduled attempt (at most 4 s away, plus one proof) serves: the same process, every frame
    assert agent.wait_exit(120) == 0, agent.log_text()[-3000:]
    assert len(agent.results()) == len(list(FRAMES.glob("*.png")))
    healed = agent.events("reproof.serving")[0]
    assert healed["variant"] in ("fp32", "int8")
    assert len(agent.events("reproof.start")) <= stopped + 2
