"""A native crash inside a bundle's pre or post graph is the stage's: the self-test child proves each stage
graph as its own step before any candidate, and serving watches each stage's session, so the death is
recorded as `stage:<pre|post>` and the bundle is refused naming the stage. Before, a crash in the post graph
was charged to whichever model candidate was on trial (and moved on to the next), and while serving it was
"a death between inferences", charged to nothing: the restarted daemon died the same way, in a loop.
Faults are real signals (`EDGE_AGENT_FAULT`); the agent is a real `edge-agent run` process."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from stage_graphs import demo_graph_bundle

from agent.config import Config
from agent.proof.isolation import prove_in_child
from agentproc import boot_to_end, demo_config


@pytest.fixture(scope="module")
def graph_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo classifier with a pre graph (stretch and normalise) and a post graph (softmax), FP32 and INT8."""
    return demo_graph_bundle(tmp_path_factory.mktemp("stage-crash"), int8=True, keep_low_quality=True)


def _crashes(state: Path) -> list[tuple[str, str, str]]:
    f = state / "selftest" / "crashes.json"
    return [(r["step"], r["signal"], r.get("detail", "")) for r in json.loads(f.read_text())] if f.exists() else []


@pytest.mark.parametrize("stage", ["pre", "post"])
def test_a_native_crash_in_a_stage_graph_during_the_self_test_is_charged_to_the_stage_not_a_candidate(
        graph_bundle: Path, tmp_path: Path, stage: str) -> None:
    cfg = Config(state_dir=tmp_path / "state", bundle=graph_bundle)
    proof = prove_in_child(graph_bundle, cfg.state_dir, cfg, 120, use_cache=False,
                           env={"EDGE_AGENT_FAULT": f"stage:{stage}=SIGSEGV"})
    assert proof.report is None and proof.error is not None
    assert proof.error.startswith(f"stage {stage}: stage:{stage} crashed the self-test process (SIGSEGV)"), proof.error
    assert "no candidate can serve this bundle" in proof.error
    assert _crashes(cfg.state_dir) == [(f"stage:{stage}", "SIGSEGV", "")]  # no candidate was charged
    again = prove_in_child(graph_bundle, cfg.state_dir, cfg, 120, use_cache=False)  # the fault is gone: still refused
    assert again.report is None and again.error is not None and again.error.startswith(f"stage {stage}:")
    assert again.crashes == ()  # refused from the record, without another child


def test_without_a_fault_the_stage_steps_pass_and_a_candidate_serves(graph_bundle: Path, tmp_path: Path) -> None:
    cfg = Config(state_dir=tmp_path / "state", bundle=graph_bundle)
    proof = prove_in_child(graph_bundle, cfg.state_dir, cfg, 120, use_cache=False)
    assert proof.passed, proof.reason
    assert _crashes(cfg.state_dir) == []


@pytest.mark.slow
def test_a_native_crash_in_the_post_graph_while_serving_is_charged_to_the_stage_and_does_not_loop(
        graph_bundle: Path, tmp_path: Path, agent_process) -> None:
    """The post graph dies on its 3rd run in the serving process (the model was not running: the old ledger
    called it a death between inferences and charged nothing, so every restart died the same way). A later
    boot records `stage:post` and refuses the bundle naming the stage, and stays up saying so: the next boot
    when the model was idle at the death, the one after when the model's inference ran beside the post graph
    (that death costs the candidate; the stage is charged when it is in flight at a second death in a row)."""
    cfg = demo_config(tmp_path, loop=False, bundle=str(graph_bundle), selection={"use_cache": False})
    fault = "stage:post#3=SIGSEGV"
    first = boot_to_end(agent_process, cfg, fault)
    assert first.returncode == -signal.SIGSEGV, first.log_text()[-2000:]
    assert _crashes(tmp_path / "state") == []
    for _ in range(2):
        nxt = agent_process(cfg, env={"EDGE_AGENT_FAULT": fault}).start()
        nxt.wait(lambda: nxt.events("boot.not_serving") or nxt.returncode is not None, timeout=120, what="boot.not_serving or an exit")
        if nxt.events("boot.not_serving"):
            break
        assert nxt.returncode == -signal.SIGSEGV, nxt.log_text()[-2000:]  # another candidate, the same stage crash
    refused = nxt.events("boot.not_serving")[0]
    assert refused["reason"].startswith("stage post: stage:post (serving: "), refused["reason"]
    assert "crashed the serving process (the serving process died)" in refused["reason"]
    assert "no candidate can serve this bundle" in refused["reason"]
    crashes = _crashes(tmp_path / "state")
    assert [c for c in crashes if c[0].startswith("stage:")] == [c for c in crashes if c[0] == "stage:post"]
    assert len([c for c in crashes if c[0] == "stage:post"]) == 1
    assert all(c[0].startswith("candidate:") for c in crashes if c[0] != "stage:post"), crashes
    assert nxt.results() == [] and nxt.proc is not None and nxt.proc.poll() is None  # up, not looping
    assert "stage:post" in [e["step"] for e in nxt.events("serving.crash_recorded")]

CONCURRENT = """
import sys
from pathlib import Path
from agent.service.serving_ledger import ServingWatch
d, key = Path(sys.argv[1]), sys.argv[2]
model = ServingWatch(d, "sha", key, faults={f"serve:{key}#1": "SIGSEGV"})
model.opened()
pre = ServingWatch(d, "sha", key, step="stage:pre", fault="stage")
pre.opened()
pre.before()     # the pre graph runs on the next frame (a preprocessing worker) ...
model.before()   # ... while the model's inference dies (the infer worker): the model's crash
"""


def test_a_model_crash_while_the_pre_graph_runs_beside_it_costs_the_candidate_not_the_whole_bundle(
        tmp_path: Path) -> None:
    """Pre, model and post run on their own threads, so a stage's in-flight byte is often 1 when the model
    dies. Both were recorded: `stage:pre` refused the whole bundle (for a week) though another candidate could
    serve it. Now the candidate is charged, and the stage only when it is in flight again at the next death."""
    import subprocess
    import sys

    from agent.proof.isolation import CrashLedger
    from agent.service import serving_ledger

    d = tmp_path / "selftest"
    d.mkdir()
    key = "CPUExecutionProvider:int8"
    root = Path(__file__).resolve().parents[2]
    for death in (1, 2):
        proc = subprocess.run([sys.executable, "-c", CONCURRENT, str(d), key], cwd=root)
        assert proc.returncode == -signal.SIGSEGV
        recorded = serving_ledger.recover(d, CrashLedger(d))
        steps = [r[0] for r in _crashes(tmp_path)]
        if death == 1:
            assert recorded == [f"candidate:{key}"], recorded
            assert steps == [f"candidate:{key}"]
        else:  # in flight at two deaths in a row: the stage is charged too
            assert recorded == ["stage:pre", f"candidate:{key}"] or recorded == [f"candidate:{key}", "stage:pre"], recorded
            assert sorted(steps) == sorted([f"candidate:{key}", "stage:pre"])
        assert not list(d.glob("serving-*.json"))
