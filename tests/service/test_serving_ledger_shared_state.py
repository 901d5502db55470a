"""Two agents on one state dir (two containers, or `edge-agent run` beside the service): a serving
marker of a LIVE process is not a crash. The next boot of the other agent used to record that
process's candidate as one that killed the serving process (7 days skipped), and delete its marker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from agent.proof.isolation import CrashLedger
from agent.service import serving_ledger

ROOT = Path(__file__).resolve().parents[2]
INT8 = "CPUExecutionProvider:int8"

HOLDER = """
import sys
from pathlib import Path
from agent.service.serving_ledger import ServingWatch
w = ServingWatch(Path(sys.argv[1]), "sha", sys.argv[2])
w.opened()
if len(sys.argv) < 4:
    w.before()  # an inference of the candidate runs (until told)
print(w.path, flush=True)
sys.stdin.readline()  # serving, within its first inferences, until told
"""


def _holder(d: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(d), INT8, *extra], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder process wrote no marker"
    return proc, Path(line)


def test_a_live_serving_marker_of_another_process_is_not_recorded(tmp_path: Path) -> None:
    d = tmp_path / "selftest"
    d.mkdir()
    proc, marker = _holder(d)
    try:
        assert serving_ledger.recover(d, CrashLedger(d)) == []
        assert marker.exists(), "the live process's marker was deleted"
        assert not (d / "crashes.json").exists()
    finally:
        proc.kill()
        proc.wait()
    # the same marker, its process now dead (SIGKILL: nothing unwound): recorded as before
    assert proc.returncode == -signal.SIGKILL
    assert serving_ledger.recover(d, CrashLedger(d)) == [f"candidate:{INT8}"]
    assert [r["step"] for r in json.loads((d / "crashes.json").read_text())] == [f"candidate:{INT8}"]
    assert not list(d.glob("serving-*"))


def test_two_processes_with_the_same_pid_never_share_a_marker_file(tmp_path: Path) -> None:
    """PID 1 in two containers on one state dir: the name carries the process token."""
    d = tmp_path / "selftest"
    w = serving_ledger.ServingWatch(d, "sha", INT8)
    assert serving_ledger.PROCESS_TOKEN[:12] in w.path.name


def test_a_swap_ends_the_old_sessions_marker_so_a_crash_opening_the_new_one_costs_only_it(tmp_path: Path) -> None:
    """An update (or reload) opens the new session while the old one, still within its first 64
    inferences, is kept for probation's restore: both markers were up, and a death opening the new
    session was recorded against the old candidate too."""
    d = tmp_path / "selftest"
    old = serving_ledger.ServingWatch(d, "sha-v1", "CPUExecutionProvider:fp32")
    old.opened()
    old.before()
    old.after({})  # serving, 1 of its first 64 inferences
    new = serving_ledger.ServingWatch(d, "sha-v2", INT8)  # the swap's new session, opening
    assert [p.name for p in d.glob("serving-*.json")] == [new.path.name]
    assert not old.path.exists() and old.active is False


def test_a_serving_process_killed_between_inferences_is_not_charged_to_its_candidate(tmp_path: Path) -> None:
    """A hung camera's watchdog abort (or an operator's SIGKILL between frames) killed a process that ran
    none of the candidate's work: it was charged to the candidate, and after two such kills under systemd
    nothing served (found by the systemd-nspawn test)."""
    d = tmp_path / "selftest"
    d.mkdir()
    proc, marker = _holder(d, "idle")
    proc.kill()
    proc.wait()
    assert serving_ledger.recover(d, CrashLedger(d)) == []
    assert not (d / "crashes.json").exists() and not list(d.glob("serving-*"))
