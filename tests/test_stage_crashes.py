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
    called it a death between inferences and charged nothing, so every restart died the same way). The next
    boot records `stage:post` and refuses the bundle naming the stage, and stays up saying so."""
    cfg = demo_config(tmp_path, loop=False, bundle=str(graph_bundle), selection={"use_cache": False})
    fault = "stage:post#3=SIGSEGV"
    first = boot_to_end(agent_process, cfg, fault)
    assert first.returncode == -signal.SIGSEGV, first.log_text()[-2000:]
    assert _crashes(tmp_path / "state") == []
    second = agent_process(cfg, env={"EDGE_AGENT_FAULT": fault}).start()
    refused = second.wait_event("boot.not_serving", timeout=120)
    assert refused["reason"].startswith("stage post: stage:post (serving: first 64 inferences) crashed the serving "
                                        "process (the serving process died)"), refused["reason"]
    assert "no candidate can serve this bundle" in refused["reason"]
    assert _crashes(tmp_path / "state") == [("stage:post", "the serving process died", "serving: first 64 inferences")]
    assert second.results() == [] and second.proc is not None and second.proc.poll() is None  # up, not looping
    assert [e["step"] for e in second.events("serving.crash_recorded")] == ["stage:post"]
