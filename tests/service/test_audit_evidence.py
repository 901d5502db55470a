"""Evidence from serving is remembered against the candidate and outlives a golden-only re-proof (issue 43):
a drifting INT8 with a proven FP32 beside it is replaced within one canary period and not re-selected by the
next re-proof (a reload) nor the next boot; a variant right only on the golden inputs is replaced once the live
audit disagrees with the reference."""

from __future__ import annotations

import json
import signal
from datetime import datetime
from pathlib import Path

import pytest

from agentproc import AgentProcess, demo_config, int8_first
from cheating import cheat_on_golden

INT8, FP32 = "CPUExecutionProvider:int8", "CPUExecutionProvider:fp32"


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _served_variants(agent: AgentProcess, after_seq: int = 0) -> set[str]:
    out = set()
    for line in agent.out_text().splitlines():
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("seq", 0) > after_seq:
                out.add(r.get("variant"))
    return out


def _skipped_reason(report: dict, key: str) -> str:
    c = next(c for c in report["candidates"] if f"{c['provider']}:{c['variant']}" == key)
    return " ".join(c["reasons"]) if c["status"] == "skipped" else f"status {c['status']}"


@pytest.mark.slow
def test_a_drifting_int8_is_replaced_by_the_proven_fp32_and_not_reselected(tmp_path: Path, agent_process) -> None:
    period = 30.0
    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 50}, output={"stdout": True},
                                           audit={"canary_period_s": period, "live_period_s": 3600}))
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": "drift:CPUExecutionProvider:int8#100=1.5"}).start()
    assert agent.wait_event("boot.ready", timeout=180)["variant"] == "int8"
    drift = agent.wait_event("audit.drift", timeout=120)
    assert drift["check"] == "canary" and drift["candidate"] == INT8
    switched = agent.wait_event("audit.switched", timeout=period + 30)
    assert switched["from"] == INT8 and switched["to"] == FP32
    assert _at(switched) - _at(drift) <= period, "not replaced within one canary period"
    # barrier: the FP32 engine attached to the audit, then results served after the switch are its
    agent.wait_event("audit.attached", lambda e: e["candidate"] == FP32, timeout=60)
    charged = agent.events("evidence.charged")[0]
    assert charged["candidate"] == INT8 and charged["check"] == "canary"
    # the next re-proof (a reload: a full golden-only proof) does not select it again
    agent.signal(signal.SIGHUP)
    ready = agent.wait_event("boot.ready", timeout=180, count=2)
    assert ready["variant"] == "fp32"
    report = json.loads((agent.state_dir / "selftest" / "report.json").read_text())
    assert "disproven while serving: canary" in _skipped_reason(report, INT8)
    assert agent.stop(60) == 0
    assert not agent.events("audit.drift")[1:], "the replacement drifted too"
    # ... nor does the next boot, without the fault: the evidence is in the state dir
    again = AgentProcess(tmp_path, cfg, name="again", env={"EDGE_AGENT_FAULT": ""}).start()
    try:
        assert again.wait_event("boot.ready", timeout=180)["variant"] == "fp32"
    finally:
        again.stop(60)


@pytest.mark.slow
def test_a_variant_right_only_on_the_golden_inputs_is_replaced_once_the_live_audit_disagrees(
        tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 20}, output={"stdout": True},
                                           audit={"canary_period_s": 0.5, "live_period_s": 0.2, "live_window": 4}))
    cheat_on_golden(Path(cfg["bundle"]))
    from agent.testing import rewrite_manifest

    rewrite_manifest(Path(cfg["bundle"]))
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": ""}).start()
    assert agent.wait_event("boot.ready", timeout=180)["variant"] == "int8"  # it passed the golden-only proof
    drift = agent.wait_event("audit.drift", timeout=120)
    assert drift["check"] == "live" and drift["candidate"] == INT8
    switched = agent.wait_event("audit.switched", timeout=60)
    assert switched["to"] == FP32
    agent.wait_event("audit.attached", lambda e: e["candidate"] == FP32, timeout=60)
    # barrier: two live windows of the FP32 judged after it, both passing
    agent.wait_event("audit.live_window", lambda e: e["candidate"] == FP32, timeout=120, count=2)
    assert agent.stop(60) == 0
    assert all(e["passed"] for e in agent.events("audit.live_window") if e["candidate"] == FP32)
    last = [json.loads(x) for x in agent.out_text().splitlines() if x.startswith("{")][-1]
    assert last["variant"] == "fp32"
    # a golden-only proof of the same bundle (the operator's selftest) passes the cheat; the evidence keeps it out,
    # until the operator clears it
    report = _selftest(agent)
    assert report["selected"]["variant"] == "fp32"
    assert "disproven while serving: live check" in _skipped_reason(report, INT8)
    assert _selftest(agent, "--forget-evidence", "--no-cache")["selected"]["variant"] == "int8"


def _selftest(agent: AgentProcess, *extra: str) -> dict:
    """`edge-agent selftest` of the agent's bundle, config and state dir: the golden-only proof."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agent", "selftest", "--bundle", agent.config["bundle"],
                          "--config", str(agent.config_path), "--state-dir", str(agent.state_dir), "--json", *extra],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_device_whose_only_candidate_was_disproven_serves_it_flagged_rather_than_nothing(
        tmp_path: Path, agent_process) -> None:
    from agent.proof.evidence import EvidenceLedger
    from agent.proof.isolation import bundle_digest

    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 20}, output={"stdout": False}))
    cfg["selection"]["variant"] = "int8"  # the only candidate
    ledger = EvidenceLedger(Path(cfg["state_dir"]) / "selftest")
    ledger.record(bundle_digest(Path(cfg["bundle"])), INT8, "live", "top-1 agreement 0.00 < 0.90", 3600)
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": ""}).start()
    assert agent.wait_event("boot.only_disproven", timeout=180)["candidates"] == [INT8]
    assert agent.wait_event("boot.ready", timeout=180)["variant"] == "int8"
    loud = agent.wait_event("serving.loud", lambda e: "disproven while serving" in e["state"], timeout=60)
    assert "DEGRADED: serving CPUExecutionProvider:int8" in loud["state"]
    assert agent.stop(60) == 0
    report = json.loads((agent.state_dir / "selftest" / "report.json").read_text())
    assert report["selected"]["variant"] == "int8"
    assert ledger.active(bundle_digest(Path(cfg["bundle"]))), "the evidence is kept"
