"""Keep proving while serving: the golden canary and the live audit see answers change after boot
(an env-driven fault in the serving path scales the served outputs from the N-th inference on), mark
health degraded with the evidence, and re-prove; a healthy agent stays `ok`."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentproc import AgentProcess, demo_config, int8_first


def _start(agent_process, tmp_path: Path, fault: str, audit: dict) -> AgentProcess:
    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 20}, output={"stdout": False}, audit=audit))
    return agent_process(cfg, env={"EDGE_AGENT_FAULT": fault}).start()


@pytest.mark.slow
def test_the_canary_sees_a_weight_change_after_boot_within_its_period(tmp_path: Path, agent_process) -> None:
    # x1.5 on the logits keeps every top-1 (the live fidelity check cannot see it); reproduction can
    # switch_on_drift off: the drifting variant keeps serving, flagged, while a self-test re-proves
    # (tests/service/test_audit_evidence.py: the default, the next proven candidate serving instead)
    agent = _start(agent_process, tmp_path, "drift:CPUExecutionProvider:int8#100=1.5",
                   {"canary_period_s": 1.0, "live_period_s": 3600, "switch_on_drift": False})
    drift = agent.wait_event("audit.drift", timeout=120)
    assert drift["check"] == "canary" and drift["candidate"] == "CPUExecutionProvider:int8"
    assert any("reproduction" in f for f in drift["findings"])
    # degraded in health (the health log line carries the STATUS text's state) and re-proven
    agent.wait_event("audit.reproving", timeout=60)
    agent.wait_event("audit.reproof_done", timeout=120)
    assert agent.stop(60) == 0
    summary = agent.events("audit.summary")[0]
    assert summary["state"] == "degraded" and summary["canary_failures"] >= 1
    assert summary["degraded"]["check"] == "canary"


@pytest.mark.slow
def test_the_live_audit_sees_answers_the_reference_does_not_give(tmp_path: Path, agent_process) -> None:
    # x-1 flips every top-1: the reference FP32 on the CPU disagrees on every live frame
    agent = _start(agent_process, tmp_path, "drift:CPUExecutionProvider:int8#100=-1",
                   {"canary_period_s": 3600, "live_period_s": 0.2, "live_window": 4, "switch_on_drift": False})
    # (the first canary, 5 s in, may see it first)
    drift = agent.wait_event("audit.drift", lambda e: e["check"] == "live", timeout=120)
    assert drift["reference"] == "CPU:fp32" and drift["candidate"] == "CPUExecutionProvider:int8"
    assert any("top-1 agreement" in f for f in drift["findings"])
    assert agent.stop(60) == 0


@pytest.mark.slow
def test_a_healthy_agent_audits_without_drift(tmp_path: Path, agent_process) -> None:
    agent = _start(agent_process, tmp_path, "", {"canary_period_s": 0.5, "live_period_s": 0.2, "live_window": 4})
    assert agent.wait_event("audit.attached", timeout=120)["golden"] == 16
    # barrier: two live windows judged (the canary runs every 0.5 s meanwhile)
    agent.wait_event("audit.live_window", lambda e: e["canary_runs"] >= 1, timeout=120, count=2)
    assert agent.stop(60) == 0
    assert not agent.events("audit.drift") and not agent.events("audit.error")
    summary = agent.events("audit.summary")[0]
    assert summary["state"] == "ok" and summary["canary_runs"] >= 1 and summary["live_windows"] >= 2
    assert summary["canary_failures"] == 0 and summary["live_drift"] == 0
