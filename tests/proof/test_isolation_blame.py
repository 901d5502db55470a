"""Blame the right step: a crash costs the candidate that was running, wherever it ran (a timed run of
the interleaved latency loop, one variant's contract, the serving process), and a stop is never a
crash. Faults are real signals (`EDGE_AGENT_FAULT`); the agent is a real `edge-agent run` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from waiting import wait_until

from agent.config import Config
from agent.proof.isolation import STOP_RETRIES, prove_in_child
from agent.testing import rewrite_manifest
from agentproc import DEMO_BUNDLE as DIGITS
from agentproc import DEMO_FRAMES as FRAMES
from agentproc import AgentProcess, boot_to_end, demo_config, int8_first

INT8 = "candidate:CPUExecutionProvider:int8"


def _config(tmp_path: Path, **overrides) -> dict:
    return int8_first(tmp_path, demo_config(tmp_path, loop=False, selection={"use_cache": False}, **overrides))


def _variants(agent: AgentProcess) -> set[str]:
    return {r["variant"] for r in agent.results()}


def _crashes(tmp_path: Path) -> list[tuple[str, str, str]]:
    f = tmp_path / "state" / "selftest" / "crashes.json"
    return [(r["step"], r["signal"], r.get("detail", "")) for r in json.loads(f.read_text())] if f.exists() else []


@pytest.mark.slow
def test_crash_on_the_nth_timed_run_is_blamed_on_that_candidate_only(tmp_path: Path, agent_process) -> None:
    # fp32 runs before int8 in each round: the old single marker named fp32 for the whole loop, so both
    # were blacklisted (the second child then blamed int8) and nothing served
    agent = boot_to_end(agent_process, _config(tmp_path), "run:CPUExecutionProvider:int8#30=SIGSEGV")
    assert agent.returncode == 0, agent.log_text()[-2000:]
    assert _variants(agent) == {"fp32"}
    assert _crashes(tmp_path) == [(INT8, "SIGSEGV", "latency run 30 of 55")]


@pytest.mark.slow
def test_a_crash_fault_past_where_the_latency_loop_would_settle_still_fires(tmp_path: Path, agent_process) -> None:
    # 30 ms a run and a 400 ms budget: the bundle's 50-run loop would settle after ~2 s (about 32 rounds),
    # so a fault on the 45th run never fired and the crash this hook exists to test was never made
    cfg = _config(tmp_path)
    rewrite_manifest(Path(cfg["bundle"]), lambda d: d["selftest"].update(latency_budget_ms={"default": 400.0}))
    flag = tmp_path / "slow"
    flag.touch()
    fault = ";".join([*(f"slow:CPUExecutionProvider:{v}={flag}" for v in ("fp32", "int8")),
                      "run:CPUExecutionProvider:int8#45=SIGSEGV"])
    agent = boot_to_end(agent_process, cfg, fault)
    assert agent.returncode == 0, agent.log_text()[-2000:]
    assert _variants(agent) == {"fp32"}
    assert _crashes(tmp_path) == [(INT8, "SIGSEGV", "latency run 45 of 55")]


def test_crash_reading_one_variants_contract_skips_only_that_variant(tmp_path: Path, agent_process) -> None:
    agent = boot_to_end(agent_process, _config(tmp_path), "contract:int8=SIGSEGV")
    assert agent.returncode == 0, agent.log_text()[-2000:]
    assert _variants(agent) == {"fp32"}
    assert _crashes(tmp_path) == [("contract:int8", "SIGSEGV", "")]
    report = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
    int8 = next(c for c in report["candidates"] if c["variant"] == "int8")
    assert "reading variant int8's contract crashed" in " ".join(int8["reasons"])


@pytest.mark.slow
def test_crash_only_in_the_serving_process_serves_the_other_variant_on_the_next_boot(tmp_path: Path,
                                                                                    agent_process) -> None:
    """The int8 passes the self-test child and dies on its 3rd inference in the serving process; the
    restart (same fault, as systemd would restart it) serves fp32: one crash, no loop."""
    cfg, fault = _config(tmp_path), "serve:CPUExecutionProvider:int8#3=SIGSEGV"
    first = boot_to_end(agent_process, cfg, fault)
    assert first.returncode == -signal.SIGSEGV, first.log_text()[-2000:]
    assert _crashes(tmp_path) == []  # nothing knew where the serving process died ...
    second = boot_to_end(agent_process, cfg, fault)
    assert second.returncode == 0, second.log_text()[-2000:]  # ... until the next boot read its marker
    assert _variants(second) == {"fp32"}
    assert _crashes(tmp_path) == [(INT8, "the serving process died", "serving: first 64 inferences")]
    assert any(e["candidate"] == INT8.removeprefix("candidate:") for e in second.events("serving.crash_recorded"))
    third = boot_to_end(agent_process, cfg, fault)  # and it stays that way: no crash loop
    assert third.returncode == 0 and _variants(third) == {"fp32"}
    assert not list((tmp_path / "state" / "selftest").glob("serving-*.json")), "a clean exit leaves no marker"


@pytest.mark.slow
def test_a_clean_stop_while_serving_leaves_no_serving_marker(tmp_path: Path, agent_process) -> None:
    # a healthy boot that serves only 3 frames (fewer than the watched inferences) and exits cleanly
    frames = tmp_path / "frames"
    frames.mkdir()
    for f in sorted(FRAMES.glob("*.png"))[:3]:
        (frames / f.name).write_bytes(f.read_bytes())
    out = boot_to_end(agent_process, _config(tmp_path, source={"path": str(frames)}))
    assert out.returncode == 0 and _variants(out) == {"int8"}
    assert not list((tmp_path / "state" / "selftest").glob("serving-*.json"))
    again = boot_to_end(agent_process, _config(tmp_path, source={"path": str(frames)}))
    assert _variants(again) == {"int8"} and _crashes(tmp_path) == []


@pytest.mark.slow
def test_sigterm_to_the_agent_during_the_self_test_is_not_a_crash(tmp_path: Path, agent_process) -> None:
    cfg = _config(tmp_path, updates={"selftest_timeout_s": 300})
    hung = agent_process(cfg, env={"EDGE_AGENT_FAULT": f"{INT8}=hang"}).start()
    inflight = tmp_path / "state" / "selftest" / "inflight.json"
    hung.wait(inflight.exists, 120, "the self-test reached the int8 trial")
    hung.signal(signal.SIGTERM)
    assert hung.wait_exit(60) == 0
    out = boot_to_end(agent_process, cfg)  # the int8 was interrupted, not crashed: it is tried, and it wins
    assert out.returncode == 0, out.log_text()[-2000:]
    assert _variants(out) == {"int8"}
    assert _crashes(tmp_path) == []


def test_sigterm_to_the_self_test_child_is_a_shutdown_not_a_crash(tmp_path: Path) -> None:
    """systemd stops the whole cgroup: the child gets SIGTERM too, while the agent is still waiting on it. A child
    stopped while its parent goes on is proven again (STOP_RETRIES times: the child alone was signalled, review
    43b); in a real stop the parent exits and the retry dies with it. Here the parent goes on, so the child is
    stopped once more than the retries: the proof then ends as a shutdown, nothing charged."""
    cfg = Config(state_dir=tmp_path / "state", bundle=DIGITS)
    result: list = []
    t = threading.Thread(target=lambda: result.append(prove_in_child(
        DIGITS, cfg.state_dir, cfg, 300, use_cache=False, env={"EDGE_AGENT_FAULT": f"{INT8}=hang"})))
    t.start()
    inflight = tmp_path / "state" / "selftest" / "inflight.json"
    for _ in range(STOP_RETRIES + 1):
        assert wait_until(inflight.exists, 120), "the self-test never reached the int8 trial"
        pids = subprocess.run(["pgrep", "-f", f"selftest_child.*{tmp_path}"], capture_output=True,
                              text=True).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGTERM)
        assert wait_until(lambda: not inflight.exists() or not t.is_alive(), 60), "the stopped child's marker stayed"
    t.join(timeout=60)
    assert result, "prove_in_child did not return"
    proof = result[0]
    assert proof.report is None and "stopped by SIGTERM (a shutdown, not a crash)" in (proof.error or "")
    assert proof.crashes == () and _crashes(tmp_path) == []
    assert not inflight.exists()


def test_a_serving_marker_left_by_a_dead_process_with_our_pid_is_still_recovered(tmp_path: Path) -> None:
    """In a container the agent is PID 1 on every boot: the marker's process token, not its PID, says
    whether it is ours."""
    from agent.fsio import write_json_atomic
    from agent.proof.isolation import CrashLedger
    from agent.service import serving_ledger

    d = tmp_path / "selftest"
    d.mkdir()
    write_json_atomic(d / "serving-1-1.json", {"bundle": "sha", "candidate": "CPUExecutionProvider:int8",
                                               "pid": os.getpid(), "process": "an earlier boot", "phase": "first 64 inferences"})
    live = serving_ledger.ServingWatch(d, "sha", "CPUExecutionProvider:fp32")  # this process's own marker
    steps = serving_ledger.recover(d, CrashLedger(d))
    assert steps == [INT8] and live.path.exists()
    assert [p.name for p in d.glob("serving-*.json")] == [live.path.name]
