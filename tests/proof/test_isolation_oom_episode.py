"""Review of issue 43 point 1: "A death with no such evidence (SIGKILL, the OOM killer ...) is recorded and retried,
not charged", unless "the same death repeated across boots (say how many)".

In the self-test child the count is per proof, not across boots: `_prove_in_child` keeps `unexplained` in a local
dict and starts the next child at once, so three SIGKILLs within seconds charge the step for 7 days. And a trial's
in-flight marker carries no detail (`CrashMarkers.enter` writes bundle, candidate, started), so every kill that lands
anywhere in a candidate's trial (session creation, golden reproduction, batches, concurrency: where memory peaks) is
"the same point". One episode of memory pressure (another process's spike lasting a few seconds, the OOM killer
picking the largest process: the child) then charges a healthy candidate for a week, on one boot.

Simulated: a watcher SIGKILLs the self-test child whenever its in-flight marker names int8 in its trial (no latency
detail), for the first three children only (the episode ends); the next boot has no killer at all."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from agentproc import demo_config, int8_first

INT8 = "CPUExecutionProvider:int8"


def _selftest_children(pid: int) -> list[int]:
    """The agent's self-test children (/proc/<pid>/task/*/children: no scan of every process)."""
    kids: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                kids.update(int(k) for k in (task / "children").read_text().split())
            except (OSError, ValueError):
                pass
    except OSError:
        return []
    out = []
    for k in kids:
        try:
            if b"selftest_child" in Path(f"/proc/{k}/cmdline").read_bytes():
                out.append(k)
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_one_oom_episode_in_one_proof_does_not_charge_a_candidate_for_a_week(tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path))
    inflight = tmp_path / "state" / "selftest" / "inflight.json"
    agent = agent_process(cfg, name="boot1").start()
    kills: list[str] = []
    killed: set[int] = set()
    stop = threading.Event()

    def killer() -> None:
        while not stop.is_set() and len(kills) < 3:
            try:
                doc = json.loads(inflight.read_text())
            except (OSError, ValueError):
                doc = None
            if isinstance(doc, dict) and doc.get("candidate") == INT8 and "detail" not in doc:
                for k in _selftest_children(agent.pid):
                    if k in killed:
                        continue
                    try:
                        os.kill(k, signal.SIGKILL)
                        killed.add(k)
                        kills.append(f"{k} at {time.time():.2f}")
                    except ProcessLookupError:
                        pass
            time.sleep(0.001)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        agent.wait_results(1, timeout=240)
    finally:
        stop.set()
        t.join(5)
        agent.stop(60)
    records = json.loads((tmp_path / "state" / "selftest" / "crashes.json").read_text()) \
        if (tmp_path / "state" / "selftest" / "crashes.json").exists() else []
    agent2 = agent_process(cfg, name="boot2").start()
    try:
        served = agent2.wait_results(1, timeout=240)[0]["variant"]
    finally:
        agent2.stop(60)
    assert len(kills) == 3, f"the episode did not happen as planned: {kills}"
    charged = [(r["step"], r["signal"]) for r in records]
    assert charged == [] and served == "int8", (f"kills {kills}; charged {charged}; the next boot, with no memory "
                                                f"pressure, served {served}")
