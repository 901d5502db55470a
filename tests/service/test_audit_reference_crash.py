"""A crash in the audit's reference session (FP32 on the CPU, opened in the serving process at the
first live sample) had no marker: every boot served, opened the reference, died, restarted - a crash
loop nothing recorded. Now the reference runs under its own marker (step `audit:<key>`): the next
boot records it, serves the same proven candidate, and runs with the live audit off, saying why."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from agentproc import AgentProcess, demo_config, int8_first

FAULT = "audit:CPUExecutionProvider:fp32#0=SIGSEGV"  # dies while opening the reference session


def _boot(agent_process, tmp_path: Path, name: str) -> AgentProcess:
    # int8 served: a served CPU:fp32 is its own reference (no second session, so no such crash)
    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 40}, output={"stdout": False},
                                           audit={"canary_period_s": 3600, "live_period_s": 0.2, "live_window": 4}))
    return agent_process(cfg, name=name, env={"EDGE_AGENT_FAULT": FAULT}).start()


@pytest.mark.slow
def test_a_crash_in_the_audit_reference_costs_the_live_audit_not_a_crash_loop(tmp_path: Path, agent_process) -> None:
    first = _boot(agent_process, tmp_path, "first")
    assert first.wait_exit(180) == -signal.SIGSEGV, first.log_text()[-2000:]  # the reference fault fired
    served = first.events("audit.attached")[0]["candidate"]

    second = _boot(agent_process, tmp_path, "second")
    off = second.wait_event("audit.no_reference", timeout=120)
    assert "audit:CPUExecutionProvider:fp32" in off["reason"] and "live audit is off" in off["reason"]
    # the same proven candidate serves: the reference's crash was not charged to it
    assert second.events("audit.attached")[0]["candidate"] == served
    assert second.returncode is None, "the second boot died too: a crash loop"
    assert second.stop(60) == 0
    steps = [r["step"] for r in json.loads((tmp_path / "state" / "selftest" / "crashes.json").read_text())]
    assert steps == ["audit:CPUExecutionProvider:fp32"]
