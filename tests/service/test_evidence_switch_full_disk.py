"""Review of issue 43 point 2 ("never keep a disproven one") with the state disk full while serving (point 4:
"serving from memory as it does when the disk fills later").

A drift the canary finds is charged (in memory: `evidence.unwritable`) and `evidence.switch_job` opens the next
proven candidate with `open_engine`, whose `ServingWatch` writes its marker with `write_json_atomic` into
<state_dir>/selftest: on a full disk that raises OSError, which `switch_job` did not catch (it catches
AgentError): the job failed, no reload was asked for, and the disproven INT8 kept serving although the proven FP32
was beside it. Now a marker that cannot be written is said (`serving.marker_unwritten`) and the session opens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentproc import DEMO_BUNDLE, demo_config
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture

INT8, FP32 = "CPUExecutionProvider:int8", "CPUExecutionProvider:fp32"


@pytest.mark.slow
def test_a_drift_on_a_full_state_disk_still_switches_to_the_proven_fp32(tmp_path: Path, small_disk: Path,  # noqa: F811
                                                                       agent_process) -> None:
    import shutil

    from agent.testing import rewrite_manifest

    state = small_disk / "state"
    bundle = tmp_path / "digits-int8-first-loose"
    shutil.copytree(DEMO_BUNDLE, bundle)

    def loose(m: dict) -> None:  # int8 first, and a budget no load here misses: both candidates pass the proof
        m["preference"]["CPUExecutionProvider"] = ["int8", "fp32"]
        m["selftest"]["latency_budget_ms"] = {"default": 5000.0}

    rewrite_manifest(bundle, loose)
    cfg = demo_config(tmp_path, state_dir=str(state), bundle=str(bundle), source={"max_fps": 30},
                      selection={"prefer_margin": 1.0}, audit={"canary_period_s": 3, "live_period_s": 3600})
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": f"drift:{INT8}#300=1.5"}).start()
    try:
        assert agent.wait_event("boot.ready", timeout=180)["variant"] == "int8"
        report = __import__("json").loads((state / "selftest" / "report.json").read_text())
        passed = [c["variant"] for c in report["candidates"] if c.get("passed")]
        assert passed == ["int8", "fp32"], f"both must pass for the switch path: {passed}"
        fill(small_disk)  # the disk fills while serving, before the drift begins (inference 300, ~10 s at 30 fps)
        agent.wait_event("evidence.charged", timeout=180)
        try:
            agent.wait_event("audit.switched", timeout=60)
            switched = True
        except AssertionError:
            switched = False
        said = [l[:400] for l in agent.log_text().splitlines()
                if any(k in l for k in ("job.failed", "audit.switch", "evidence.", "reload.", "boot.not_serving"))]
        n = len(agent.results())
        agent.wait(lambda: len(agent.results()) > n + 20, timeout=60, what="results after the drift")
        tail_variants = {r["variant"] for r in agent.results()[-10:]}
    finally:
        agent.stop(60)
    assert switched and tail_variants == {"fp32"}, f"serving {tail_variants} after the drift; " + " | ".join(said)[-2500:]
