"""The fault catalogue of crash loops: a provider, a variant, a cached winner or the bundle check that
kills the process must cost that step, not every boot. Faults are real signals raised in the self-test
child (`EDGE_AGENT_FAULT`); the agent is a real `edge-agent run` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agent.proof.isolation import CrashLedger, CrashRecord, parse_faults
from agent.proof.probe import provider_versions
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
FRAMES = ROOT / "models" / "demo-frames" / "digits"
INT8 = "candidate:CPUExecutionProvider:int8"


def _config(tmp_path: Path, **overrides) -> Path:
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "bundle": str(ROOT / "models" / "digits-classifier"),
        "source": {"type": "folder", "path": str(FRAMES)},
        "output": {"health_interval_s": 0.5},
        **overrides,
    }
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _run(cfg: Path, fault: str | None = None, timeout: float = 180) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "EDGE_AGENT_FAULT": fault or ""}
    out = subprocess.run([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=timeout)
    events = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
    return out, events


def _results(out: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(x) for x in out.stdout.splitlines() if x.strip()]


def _crashes(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "state" / "selftest" / "crashes.json").read_text())


def test_segfaulting_provider_probe_boots_to_serving_on_the_first_boot(tmp_path: Path) -> None:
    out, events = _run(_config(tmp_path), "probe:CUDAExecutionProvider=SIGSEGV")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(_results(out)) == len(list(FRAMES.glob("*.png")))
    crashed = [e for e in events if e["event"] == "selftest.step_crashed"]
    assert [(e["step"], e["signal"]) for e in crashed] == [("probe:CUDAExecutionProvider", "SIGSEGV")]
    rec = _crashes(tmp_path)[0]
    assert rec["versions"]["onnxruntime"] and rec["expires"] > time.time()
    report = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
    cuda = next(p for p in report["providers"] if p["name"] == "CUDAExecutionProvider")
    assert not cuda["usable"] and "SIGSEGV" in cuda["reason"]


@pytest.mark.parametrize("sig,named", [("SIGSEGV", "SIGSEGV"), ("SIGABRT", "SIGABRT"),
                                       ("SIGKILL", "SIGKILL (out of memory?)")])
def test_segfaulting_variant_boots_to_serving_on_the_next_candidate(tmp_path: Path, sig: str, named: str) -> None:
    out, events = _run(_config(tmp_path, selection={"use_cache": False}), f"{INT8}={sig}")
    assert out.returncode == 0, out.stderr[-2000:]
    results = _results(out)
    assert results and {r["variant"] for r in results} == {"fp32"}
    assert [(r["step"], r["signal"]) for r in _crashes(tmp_path)] == [(INT8, named)]


def test_segfaulting_cached_winner_boots_to_serving_on_the_first_boot_after_the_fault(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    out, _ = _run(cfg)  # a healthy boot: int8 wins and is cached
    assert out.returncode == 0 and {r["variant"] for r in _results(out)} == {"int8"}
    out, events = _run(cfg, f"{INT8}=SIGSEGV")  # the driver changed under the cached winner
    assert out.returncode == 0, out.stderr[-2000:]
    assert {r["variant"] for r in _results(out)} == {"fp32"}
    assert any(e["event"] == "selftest.step_crashed" and e["step"] == INT8 for e in events)


def test_hanging_trial_is_timed_out_and_the_next_candidate_serves(tmp_path: Path) -> None:
    # The time-out bounds a whole self-test child (start-up, probes, every candidate), not one trial: at
    # 8 s a loaded CI machine timed out the healthy child too, or charged the hang to the step before it.
    cfg = _config(tmp_path, selection={"use_cache": False}, updates={"selftest_timeout_s": 30})
    out, _ = _run(cfg, f"{INT8}=hang", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert {r["variant"] for r in _results(out)} == {"fp32"}
    assert [(r["step"], r["signal"]) for r in _crashes(tmp_path)] == [(INT8, "timeout after 30 s")]


def test_crash_while_loading_the_bundle_is_not_serving_with_the_signal_named(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(_config(tmp_path))],
                            cwd=ROOT, env={**os.environ, "EDGE_AGENT_FAULT": "load=SIGABRT"},
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    # wait for the verdict itself (a fixed 6 s was too short on a loaded machine: SIGTERM came first)
    said = wait_until(lambda: '"boot.not_serving"' in log.read_text(), 120)
    time.sleep(1.0)  # ... and it stays up after saying so
    assert proc.poll() is None, "the agent died instead of staying up, not serving"
    assert said, log.read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == ""
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    reason = next(e for e in events if e["event"] == "boot.not_serving")["reason"]
    assert "load crashed the self-test process (SIGABRT)" in reason


def test_forget_crashes_lets_a_crashed_step_be_tried_again(tmp_path: Path) -> None:
    cfg = _config(tmp_path, selection={"use_cache": False})
    out, _ = _run(cfg, f"{INT8}=SIGSEGV")
    assert {r["variant"] for r in _results(out)} == {"fp32"}
    out, _ = _run(cfg)  # the record still applies: int8 is skipped, not retried
    assert {r["variant"] for r in _results(out)} == {"fp32"}
    forget = subprocess.run([sys.executable, "-m", "agent", "selftest", "--forget-crashes", "--state-dir",
                             str(tmp_path / "state")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert forget.returncode == 0 and "forgot 1 crash record" in forget.stderr
    out, _ = _run(cfg)
    assert {r["variant"] for r in _results(out)} == {"int8"}


def test_selftest_command_survives_a_segfaulting_candidate(tmp_path: Path) -> None:
    """`edge-agent selftest` used to exit 139 on every run; now the crash is a verdict in the table."""
    out = subprocess.run([sys.executable, "-m", "agent", "selftest", "--bundle", str(ROOT / "models" / "digits-classifier"),
                          "--state-dir", str(tmp_path), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "EDGE_AGENT_FAULT": f"{INT8}=SIGSEGV"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "selected: CPU:fp32" in out.stdout and "crashed: candidate:CPUExecutionProvider:int8 crashed" in out.stdout


def test_crash_records_expire_and_stop_applying_when_versions_change(tmp_path: Path) -> None:
    ledger = CrashLedger(tmp_path, ttl_s=3600)
    ledger.record(INT8, "sha", "SIGSEGV")
    ledger.record("probe:CUDAExecutionProvider", "sha", "SIGABRT")
    assert set(ledger.active("sha")) == {INT8, "probe:CUDAExecutionProvider"}
    assert set(ledger.active("other-bundle")) == {"probe:CUDAExecutionProvider"}  # a probe is not per bundle
    assert ledger.active("sha", now=time.time() + 7200) == {}  # expired
    records = json.loads((tmp_path / "crashes.json").read_text())
    records[0]["versions"] = {**provider_versions("CPUExecutionProvider"), "onnxruntime": "0.0.1"}
    (tmp_path / "crashes.json").write_text(json.dumps(records))
    assert set(ledger.active("sha")) == {"probe:CUDAExecutionProvider"}  # ORT changed: int8 is tried again
    assert CrashRecord.from_dict(records[1]).provider == "CUDAExecutionProvider"


def test_fault_hook_is_inert_without_the_variable() -> None:
    assert parse_faults(None) == {} and parse_faults("") == {}
    assert parse_faults(f"{INT8}@2=SIGSEGV;load=hang") == {f"{INT8}@2": "SIGSEGV", "load": "hang"}
    # the hook is imported by the child only: the serving process never loads it
    code = ("import agent.service.controller, sys; "
            "print('agent.service.selftest_child' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sigterm_during_a_hanging_boot_proof_exits_promptly_and_leaves_no_child(tmp_path: Path) -> None:
    cfg = _config(tmp_path, updates={"selftest_timeout_s": 300})
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)], cwd=ROOT,
                            env={**os.environ, "EDGE_AGENT_FAULT": "load=hang"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = lambda: subprocess.run(["pgrep", "-f", f"selftest_child.*{tmp_path}"],  # noqa: E731
                                      capture_output=True, text=True).stdout.strip()
    # SIGTERM while the child hangs in the proof (a fixed 3 s could land before the child existed)
    assert wait_until(lambda: children() != "", 60), "the self-test child never started"
    proc.send_signal(signal.SIGTERM)
    # promptly: far inside the 300 s self-test time-out it would otherwise wait out (60 s is for load)
    assert proc.wait(timeout=60) == 0
    left = children() if not wait_until(lambda: children() == "", 15) else ""
    assert left == "", f"self-test children left running: {left}"
