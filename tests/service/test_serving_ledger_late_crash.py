"""A variant that kills the serving process only after its first 64 inferences (the serving marker's
window) crash-looped the daemon: 3 of 3 boots ready, SIGSEGV at inference 100, restart, the same
candidate, nothing recorded. Now the marker stays for the engine's life; a death past the window
costs the candidate when it repeats in the next serving process (a one-off kill does not)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from agent.fsio import write_json_atomic
from agent.proof.isolation import CrashLedger
from agent.service import serving_ledger
from agentproc import demo_config, int8_first

INT8 = "CPUExecutionProvider:int8"
FAULT = f"serve:{INT8}#100=SIGSEGV"


def _crashes(tmp_path: Path) -> list[tuple[str, str]]:
    f = tmp_path / "state" / "selftest" / "crashes.json"
    return [(r["step"], r.get("detail", "")) for r in json.loads(f.read_text())] if f.exists() else []


@pytest.mark.slow
def test_a_crash_past_the_first_64_inferences_ends_the_crash_loop(tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path, selection={"use_cache": False}))
    for boot in (1, 2):  # the same candidate dies at inference 100 twice in a row
        agent = agent_process(cfg, name=f"boot{boot}", env={"EDGE_AGENT_FAULT": FAULT})
        assert agent.run(180) == -signal.SIGSEGV, agent.log_text()[-2000:]
    # the second boot recorded the first's death as noted only; the third records the second's
    agent = agent_process(cfg, name="boot3", env={"EDGE_AGENT_FAULT": FAULT}).start()
    assert agent.wait_results(1)[0]["variant"] == "fp32"
    agent.wait_event("serving.watch_done")
    assert agent.returncode is None
    assert agent.stop(60) == 0
    assert _crashes(tmp_path) == [(f"candidate:{INT8}", "serving: past its first 64 inferences, 2 processes in a row")]


def _late_marker(d: Path, **over: object) -> None:
    write_json_atomic(d / "serving-1-dead-1.json", {
        "bundle": "sha", "candidate": INT8, "step": f"candidate:{INT8}", "process": "a dead one",
        "phase": "serving, past its first 64 inferences", "late": True, "boot_id": serving_ledger.boot_id(), **over})


def test_one_late_death_is_noted_and_a_clean_end_forgets_it(tmp_path: Path) -> None:
    d = tmp_path / "selftest"
    d.mkdir()
    _late_marker(d)
    assert serving_ledger.recover(d, CrashLedger(d)) == []  # one death past the window: noted only
    w = serving_ledger.ServingWatch(d, "sha", INT8, runs=2)  # the next process serves it past the window...
    for _ in range(2):
        w.before()
        w.after({})
    assert w.path.exists() and json.loads(w.path.read_text())["late"] is True
    del w  # ...and ends cleanly (an engine dropped, a clean exit): the noted death is forgotten
    assert not list(d.glob("serving-*.json"))
    _late_marker(d)
    assert serving_ledger.recover(d, CrashLedger(d)) == []
    _late_marker(d)
    assert serving_ledger.recover(d, CrashLedger(d)) == [f"candidate:{INT8}"]  # two in a row


def test_a_late_marker_from_before_a_reboot_is_no_crash(tmp_path: Path) -> None:
    d = tmp_path / "selftest"
    d.mkdir()
    for _ in range(3):
        _late_marker(d, boot_id="another boot")
        assert serving_ledger.recover(d, CrashLedger(d)) == []
    assert not (d / "crashes.json").exists()
