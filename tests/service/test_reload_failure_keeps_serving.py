"""Review of issue 43 point 2 ("a reload or re-proof that fails keeps the proven engine serving and says why"):
`Reloads._apply` keeps the old engine when the reload's boot *returns* a refusal, but `Reloads._job` stops the
pipeline and clears the engine (`_stop_for`) before `boot()`, and when `boot()` *raises* `_apply` never runs: the
device serves nothing from then on, health says "reloading" for ever.

`boot()` catches AgentError and a disk-full OSError only; a reload now takes any exception out of it as its
refusal (`reload.proof_raised`) and the proven engine serves on. What raised in practice:
- the state filesystem turned read-only (ext4 `errors=remount-ro` after an SD-card error): the proof's skip-list
  write raises OSError(EROFS);
- a state file that is valid JSON of the wrong type (see tests/service/test_damaged_state_files.py).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentproc import demo_config


def _serving_after_hup(agent, before: int, wait_s: float = 60.0) -> tuple[int, str]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
    after = len(agent.results())
    said = [l for l in agent.log_text().splitlines()
            if any(k in l for k in ("reload.", "job.failed", "not_serving"))]
    return after - before, " | ".join(x[:300] for x in said)[-2500:]


@pytest.mark.slow
def test_a_reload_whose_proof_raises_keeps_the_proven_engine(tmp_path: Path, agent_process) -> None:
    cfg = demo_config(tmp_path, source={"max_fps": 20})
    agent = agent_process(cfg, name="agent").start()
    try:
        agent.wait_results(5, timeout=180)
        # the proof's marker path made a directory: the parent's clean-up of it raises IsADirectoryError out of
        # boot() (as EROFS would on a state disk remounted read-only). A wrong-type served.json raised here before
        # state files were type-checked (tests/service/test_damaged_state_files.py)
        (tmp_path / "state" / "selftest" / "step.json").mkdir()
        time.sleep(2.0)
        agent.signal(signal.SIGHUP)
        agent.wait_event("reload.start", timeout=60)
        before = len(agent.results())
        new, said = _serving_after_hup(agent, before)
    finally:
        if agent.returncode is None:
            agent.stop(60)
    assert new > 0, f"no result in 60 s after the reload; {said}"


def _mount_tmpfs(d: Path, size: str) -> bool:
    d.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_reload_on_a_read_only_state_disk_keeps_the_proven_engine(tmp_path: Path, agent_process) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        cfg = demo_config(tmp_path, state_dir=str(disk / "state"), source={"max_fps": 20})
        agent = agent_process(cfg, name="agent").start()
        try:
            agent.wait_results(5, timeout=180)
            ro = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
            if ro.returncode != 0:  # tmpfs refuses a read-only remount while the agent has files open for writing
                pytest.skip(f"could not remount the state disk read-only: {ro.stderr.strip()[:200]}")
            agent.signal(signal.SIGHUP)
            agent.wait_event("reload.start", timeout=60)
            before = len(agent.results())
            new, said = _serving_after_hup(agent, before)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
            if agent.returncode is None:
                agent.stop(60)
        assert new > 0, f"no result in 60 s after the reload on a read-only state disk; {said}"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
