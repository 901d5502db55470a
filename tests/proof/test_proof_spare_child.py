"""Cold start (issue 24 item 4): `edge-agent run` starts its boot proof's child before importing itself, and
the proof adopts it only when it is the very process the proof would have spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from agent.proof import spare

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _children_of(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-a", "-P", str(pid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if spare.CHILD_MODULE in line]


def test_a_cold_run_proves_in_the_spare_with_the_same_verdict_and_leaves_no_child(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO),
                                   "source": {"type": "folder", "path": str(FRAMES)}}))
    run = subprocess.run([sys.executable, "-m", "agent", "--log-json", "--log-level", "info", "run", "--config",
                          str(cfg), "--max-frames", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    started = [e for e in events if e["event"] == "selftest.child_started"]
    assert [e["spare"] for e in started] == [True], started
    assert len(run.stdout.splitlines()) == 1  # served its first result from the proof the spare made
    report = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
    assert report["passed"] and not report["cached"]
    left = subprocess.run(["pgrep", "-f", f"{spare.SPARE_FLAG} {cfg}"], capture_output=True, text=True).stdout
    assert left == "", f"spare left running: {left}"

    # the same proof in a child spawned the old way reaches the same verdict
    from agent.config import load_config
    from agent.proof.isolation import prove_in_child

    again = prove_in_child(DEMO, tmp_path / "state2", load_config(cfg), 300)
    assert again.report is not None
    assert again.report["selected"]["provider"] == report["selected"]["provider"]
    assert {c["variant"]: c["status"] for c in again.report["candidates"]} == \
        {c["variant"]: c["status"] for c in report["candidates"]}


def test_a_spare_is_refused_when_its_command_or_an_import_time_variable_differs_or_it_is_old(
        tmp_path: Path) -> None:
    base = dict(os.environ)
    for cmd, env, age in (
        ([sys.executable, "-m", "agent.service.other_module", "--bundle", "x"], base, 0.0),  # another program
        ([*spare.child_prefix(), "--bundle", "x"], {**base, "OMP_NUM_THREADS": "1"}, 0.0),  # read at import
        ([*spare.child_prefix(), "--bundle", "x"], base, spare.ADOPT_WITHIN_S + 1),  # near its own idle exit
    ):
        spare.start(str(tmp_path))
        proc = spare._spare.proc if spare._spare else None
        assert proc is not None and spare._spare is not None
        spare._spare.started -= age
        assert spare.adopt(cmd, env) is None
        assert proc.poll() is not None, "a refused spare is ended, not left waiting"
        assert spare._spare is None


def test_a_spare_takes_the_late_read_variables_and_an_unadopted_one_is_ended(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    spare.start(str(tmp_path))
    env = {**os.environ, "EDGE_AGENT_FAULT": "load=SIGABRT"}  # read by the child after its arguments arrive
    proc = spare.adopt([*spare.child_prefix(), "--bundle", str(DEMO), "--state-dir", str(tmp_path / "state"),
                        "--out", str(out)], env)
    assert proc is not None
    proc.wait(timeout=120)
    assert proc.returncode == -6, "the fault the agent set after the spare started was applied (SIGABRT at load)"
    proc.stderr.close() if proc.stderr else None

    spare.start(str(tmp_path))
    waiting = spare._spare.proc if spare._spare else None
    assert waiting is not None and waiting.poll() is None
    spare.discard()
    assert waiting.poll() is not None and spare._spare is None
    assert _children_of(os.getpid()) == [], "no spare left behind"
