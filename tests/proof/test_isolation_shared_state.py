"""Two proofs on one state dir (`edge-agent selftest` run beside the service, or two agents): the
second used to clear the running child's marker as "interrupted" and write its own into the same
files, so a crash of the first child was charged to another candidate or to none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from waiting import wait_until

from agent.config import Config
from agent.proof.isolation import PROOF_LOCK, prove_in_child

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "models" / "digits-classifier"
INT8 = "candidate:CPUExecutionProvider:int8"


def _blocked_on(lock: Path) -> bool:
    """A process waits on `lock` (flock): /proc/locks lists its request with "->" and the file's inode."""
    if not lock.exists():
        return False
    ino = f":{lock.stat().st_ino}"
    return any("->" in line and any(f.endswith(ino) for f in line.split())
               for line in Path("/proc/locks").read_text().splitlines())


def test_a_second_proof_on_the_same_state_dir_never_steals_the_first_childs_marker(tmp_path: Path) -> None:
    cfg = Config(state_dir=tmp_path / "state", bundle=DIGITS)
    inflight = tmp_path / "state" / "selftest" / "inflight.json"
    results: dict[str, object] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", prove_in_child(
        DIGITS, cfg.state_dir, cfg, 300, use_cache=False, env={"EDGE_AGENT_FAULT": f"{INT8}=hang"})))
    first.start()
    assert wait_until(lambda: inflight.exists() and "int8" in inflight.read_text(), 120), "int8 never tried"
    pids = subprocess.run(["pgrep", "-f", f"selftest_child.*{tmp_path}"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1
    second = threading.Thread(target=lambda: results.setdefault("second", prove_in_child(
        DIGITS, cfg.state_dir, cfg, 300, use_cache=False)))
    second.start()
    # the old code cleared the marker at once (and its own child then wrote others): give it the chance,
    # a barrier rather than 10 s: the marker cleared (the fault), or the second proof blocked on the lock
    marker_cleared = lambda: not inflight.exists() or "int8" not in inflight.read_text()  # noqa: E731
    assert wait_until(lambda: marker_cleared() or _blocked_on(inflight.parent / PROOF_LOCK), 120), \
        "the second proof neither cleared the marker nor waited for the lock"
    # the first child dies in the int8 trial, as a driver crash would (a fatal signal: a SIGKILL is no
    # evidence against the step, and is retried)
    os.kill(int(pids[0]), signal.SIGSEGV)
    first.join(timeout=240)
    second.join(timeout=240)
    one, two = results.get("first"), results.get("second")
    assert one is not None and two is not None, "a proof did not return"
    assert [(c.step, c.signal) for c in one.crashes] == [(INT8, "SIGSEGV")], one.error  # type: ignore[attr-defined]
    assert two.passed and two.report["selected"]["variant"] == "fp32"  # type: ignore[attr-defined]
    records = json.loads((tmp_path / "state" / "selftest" / "crashes.json").read_text())
    assert [r["step"] for r in records] == [INT8]
