"""A variant that kills the serving process only after its first 64 inferences (the serving marker's
window) crash-looped the daemon: 3 of 3 boots ready, SIGSEGV at inference 100, restart, the same
candidate, nothing recorded. Now the marker stays for the engine's life; a death past the window
costs the candidate when it repeats in the next serving process (a one-off kill does not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from waiting import wait_until

from agent.fsio import write_json_atomic
from agent.proof.isolation import CrashLedger
from agent.service import serving_ledger

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"
INT8 = "CPUExecutionProvider:int8"
FAULT = f"serve:{INT8}#100=SIGSEGV"


def _config(tmp_path: Path) -> Path:
    cfg = {"state_dir": str(tmp_path / "state"), "bundle": str(DIGITS),
           "source": {"type": "folder", "path": str(FRAMES), "loop": True, "max_fps": 200},
           "output": {"health_interval_s": 0.5}, "selection": {"use_cache": False}}
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _popen(cfg: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)], cwd=ROOT,
                            env={**os.environ, "EDGE_AGENT_FAULT": FAULT}, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)  # noqa: SIM115 (the process owns it)


def _crashes(tmp_path: Path) -> list[tuple[str, str]]:
    f = tmp_path / "state" / "selftest" / "crashes.json"
    return [(r["step"], r.get("detail", "")) for r in json.loads(f.read_text())] if f.exists() else []


@pytest.mark.slow
def test_a_crash_past_the_first_64_inferences_ends_the_crash_loop(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    for boot in (1, 2):  # the same candidate dies at inference 100 twice in a row
        log = tmp_path / f"boot{boot}.log"
        proc = _popen(cfg, log)
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"boot {boot} did not die: " + log.read_text()[-2000:]) from None
        assert rc == -signal.SIGSEGV, log.read_text()[-2000:]
    # the second boot recorded the first's death as noted only; the third records the second's
    log = tmp_path / "boot3.log"
    proc = _popen(cfg, log)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first, log.read_text()[-2000:]
        assert json.loads(first)["variant"] == "fp32"
        assert wait_until(lambda: "serving.watch_done" in log.read_text(), 60)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
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
