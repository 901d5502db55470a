"""A native crash in the serving process is charged to the session whose thread died: the fault file
(Python's faulthandler) names the thread, each marker's in-flight record names the threads its session ran
on. Pre, model and post run on their own threads, so under load another session is often in flight beside
the one that died; that one is not charged (a CI run under load charged `stage:pre` beside a post graph's
crash, two deaths in a row)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.proof.isolation import CrashLedger
from agent.service import serving_ledger

ROOT = Path(__file__).resolve().parents[2]
KEY = "CPUExecutionProvider:int8"

# argv: state dir, which session's thread dies ("model" or "pre"), "dump" to keep the fault file
TWO_THREADS = """
import sys, threading
from pathlib import Path
from agent.service.serving_ledger import ServingWatch, watch_faults
d, dies, dump = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "dump"
if dump:
    watch_faults(d)
key = "CPUExecutionProvider:int8"
victim = "serve:" + key + "#1" if dies == "model" else "stage:pre#1"
faults = {victim: "SIGSEGV"}
model = ServingWatch(d, "sha", key, faults=faults)
model.opened()
pre = ServingWatch(d, "sha", key, faults=faults, step="stage:pre", fault="stage")
pre.opened()
first, second = (pre, model) if dies == "model" else (model, pre)
beside = threading.Event()
def bystander():
    first.before()  # in flight on its own thread, and stays so ...
    beside.set()
    threading.Event().wait()
threading.Thread(target=bystander, daemon=True).start()
beside.wait()
second.before()  # ... while this thread dies in the other session
"""


def _die(d: Path, dies: str, dump: bool = True) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", TWO_THREADS, str(d), dies, "dump" if dump else "-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    return serving_ledger.recover(d, CrashLedger(d))


def _steps(d: Path) -> list[str]:
    f = d / "crashes.json"
    return sorted(r["step"] for r in json.loads(f.read_text())) if f.exists() else []


def test_a_model_crash_with_the_pre_graph_in_flight_beside_it_never_charges_the_stage(tmp_path: Path) -> None:
    for _ in range(2):  # two deaths in a row: the heuristic alone charged the stage at the second
        assert _die(tmp_path, "model") == [f"candidate:{KEY}"]
    assert _steps(tmp_path) == [f"candidate:{KEY}"]  # one record per step
    assert not list(tmp_path.glob("serving-*")), "every marker and fault file of the dead processes is gone"


def test_a_pre_graph_crash_with_the_model_in_flight_beside_it_charges_the_stage_at_once(tmp_path: Path) -> None:
    assert _die(tmp_path, "pre") == ["stage:pre"]  # the heuristic charged the model candidate here
    assert _steps(tmp_path) == ["stage:pre"]


def test_without_a_fault_file_the_blame_falls_back_to_the_in_flight_rules(tmp_path: Path) -> None:
    assert _die(tmp_path, "pre", dump=False) == [f"candidate:{KEY}"]  # the model ran: it is charged


def test_a_live_process_s_fault_file_is_left_alone(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from agent.service.serving_ledger import watch_faults; watch_faults(Path(sys.argv[1])); "
                               "print('up', flush=True); sys.stdin.read()", str(tmp_path)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        assert serving_ledger.recover(tmp_path, CrashLedger(tmp_path)) == []
        assert len(list(tmp_path.glob("serving-*.fault"))) == 1
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    assert not list(tmp_path.glob("serving-*.fault")), "a clean exit removes its fault file"


@pytest.mark.parametrize("raw,threads", [(b"0" + b" " * 127, set()), (b"1 1f,a0" + b" " * 10, {0x1F, 0xA0}),
                                         (b"1", set()), (b"\xff\xfe", set())])
def test_the_in_flight_record_reads_back_its_threads(raw: bytes, threads: set[int]) -> None:
    assert serving_ledger.flight_threads(raw) == threads
