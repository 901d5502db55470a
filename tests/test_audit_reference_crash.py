"""A crash in the audit's reference session (FP32 on the CPU, opened in the serving process at the
first live sample) had no marker: every boot served, opened the reference, died, restarted - a crash
loop nothing recorded. Now the reference runs under its own marker (step `audit:<key>`): the next
boot records it, serves the same proven candidate, and runs with the live audit off, saying why."""

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

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"
FAULT = "audit:CPUExecutionProvider:fp32#0=SIGSEGV"  # dies while opening the reference session


def _start(tmp_path: Path, log: Path) -> subprocess.Popen:
    cfg = {"state_dir": str(tmp_path / "state"), "bundle": str(DIGITS),
           "source": {"type": "folder", "path": str(FRAMES), "loop": True, "max_fps": 40},
           "output": {"health_interval_s": 0.5, "stdout": False},
           "audit": {"canary_period_s": 3600, "live_period_s": 0.2, "live_window": 4}}
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(tmp_path / "agent.yaml")],
                            cwd=ROOT, env={**os.environ, "EDGE_AGENT_FAULT": FAULT}, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))  # noqa: SIM115 (the process owns it)


def _events(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]


@pytest.mark.slow
def test_a_crash_in_the_audit_reference_costs_the_live_audit_not_a_crash_loop(tmp_path: Path) -> None:
    first = tmp_path / "first.log"
    proc = _start(tmp_path, first)
    try:
        rc = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the reference fault never fired: " + first.read_text()[-2000:]) from None
    assert rc == -signal.SIGSEGV, first.read_text()[-2000:]
    served = next(e for e in _events(first) if e["event"] == "audit.attached")["candidate"]

    second = tmp_path / "second.log"
    proc = _start(tmp_path, second)
    try:
        off = lambda: [e for e in _events(second) if e["event"] == "audit.no_reference"]  # noqa: E731
        assert wait_until(off, 120), second.read_text()[-3000:]
        assert "audit:CPUExecutionProvider:fp32" in off()[0]["reason"] and "live audit is off" in off()[0]["reason"]
        # the same proven candidate serves: the reference's crash was not charged to it
        assert next(e for e in _events(second) if e["event"] == "audit.attached")["candidate"] == served
        assert proc.poll() is None, "the second boot died too: a crash loop"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    steps = [r["step"] for r in json.loads((tmp_path / "state" / "selftest" / "crashes.json").read_text())]
    assert steps == ["audit:CPUExecutionProvider:fp32"]
