"""Keep proving while serving: the golden canary and the live audit see answers change after boot
(an env-driven fault in the serving path scales the served outputs from the N-th inference on), mark
health degraded with the evidence, and re-prove; a healthy agent stays `ok`."""

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


def _start(tmp_path: Path, fault: str, audit: dict) -> tuple[subprocess.Popen, Path]:
    cfg = {"state_dir": str(tmp_path / "state"), "bundle": str(DIGITS),
           "source": {"type": "folder", "path": str(FRAMES), "loop": True, "max_fps": 20},
           "output": {"health_interval_s": 0.5, "stdout": False}, "audit": audit}
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "agent.log"
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(tmp_path / "agent.yaml")],
                            cwd=ROOT, env={**os.environ, "EDGE_AGENT_FAULT": fault}, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))  # noqa: SIM115 (the process owns it)
    return proc, log


def _events(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_the_canary_sees_a_weight_change_after_boot_within_its_period(tmp_path: Path) -> None:
    # x1.5 on the logits keeps every top-1 (the live fidelity check cannot see it); reproduction can
    proc, log = _start(tmp_path, "drift:CPUExecutionProvider:int8#100=1.5",
                       {"canary_period_s": 1.0, "live_period_s": 3600})
    try:
        assert wait_until(lambda: any(e["event"] == "audit.drift" for e in _events(log)), 120), log.read_text()[-3000:]
        drift = next(e for e in _events(log) if e["event"] == "audit.drift")
        assert drift["check"] == "canary" and drift["candidate"] == "CPUExecutionProvider:int8"
        assert any("reproduction" in f for f in drift["findings"])
        # degraded in health (the health log line carries the STATUS text's state) and re-proven
        assert wait_until(lambda: any(e["event"] == "audit.reproving" for e in _events(log)), 60)
        assert wait_until(lambda: any(e["event"] == "audit.reproof_done" for e in _events(log)), 120)
    finally:
        _stop(proc)
    summary = next(e for e in _events(log) if e["event"] == "audit.summary")
    assert summary["state"] == "degraded" and summary["canary_failures"] >= 1
    assert summary["degraded"]["check"] == "canary"


@pytest.mark.slow
def test_the_live_audit_sees_answers_the_reference_does_not_give(tmp_path: Path) -> None:
    # x-1 flips every top-1: the reference FP32 on the CPU disagrees on every live frame
    proc, log = _start(tmp_path, "drift:CPUExecutionProvider:int8#100=-1",
                       {"canary_period_s": 3600, "live_period_s": 0.2, "live_window": 4})
    try:
        live = lambda: [e for e in _events(log) if e["event"] == "audit.drift" and e["check"] == "live"]  # noqa: E731
        assert wait_until(live, 120), log.read_text()[-3000:]  # (the first canary, 5 s in, may see it first)
        drift = live()[0]
        assert drift["reference"] == "CPU:fp32" and drift["candidate"] == "CPUExecutionProvider:int8"
        assert any("top-1 agreement" in f for f in drift["findings"])
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_healthy_agent_audits_without_drift(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, "", {"canary_period_s": 0.5, "live_period_s": 0.2, "live_window": 4})
    try:
        assert wait_until(lambda: any(e["event"] == "audit.attached" for e in _events(log)), 120), \
            log.read_text()[-3000:]
        attached = next(e for e in _events(log) if e["event"] == "audit.attached")
        assert attached["golden"] == 16
        # barrier: two live windows judged (the canary runs every 0.5 s meanwhile)
        assert wait_until(lambda: sum(e["event"] == "audit.live_window" and e["canary_runs"] >= 1
                                      for e in _events(log)) >= 2, 120), log.read_text()[-3000:]
    finally:
        _stop(proc)
    assert not any(e["event"] in ("audit.drift", "audit.error") for e in _events(log))
    summary = next(e for e in _events(log) if e["event"] == "audit.summary")
    assert summary["state"] == "ok" and summary["canary_runs"] >= 1 and summary["live_windows"] >= 2
    assert summary["canary_failures"] == 0 and summary["live_drift"] == 0
