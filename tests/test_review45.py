"""Review of issue 45: `run` with a bundle it can never serve and no way to receive one exits 1 (as `config
check` refuses it). A bundle whose model file is corrupt but whose manifest hashes match it (a careless build)
is refused by `config check` (`cannot serve: key bundle: ... ONNX Runtime cannot load variant ...`), and `run`
logs `boot.not_serving` with `next_attempt: "none by itself"`, yet stays up, not serving, ignoring --max-frames."""

from __future__ import annotations

import shutil
from pathlib import Path

from agentproc import DEMO_BUNDLE, demo_config
from agent.testing import rewrite_manifest


def test_a_model_file_onnx_runtime_cannot_load_with_no_way_to_receive_another_exits_1(tmp_path: Path,
                                                                                      agent_process) -> None:
    bundle = tmp_path / "digits-classifier"
    shutil.copytree(DEMO_BUNDLE, bundle)
    (bundle / "model_int8.onnx").write_bytes(b"not a protobuf" * 8)
    rewrite_manifest(bundle)  # hashes match the corrupt file: only loading it can tell
    agent = agent_process(demo_config(tmp_path, loop=False, bundle=str(bundle)), args=("--max-frames", "3")).start()
    try:
        verdict = agent.wait_event("boot.not_serving", timeout=240)
        assert verdict["next_attempt"].startswith("none by itself"), verdict
        # It says nothing will change by itself, updates are off and MQTT is off: it must end, as config check says.
        assert agent.wait_exit(60) == 1, agent.log_text()[-2000:]
    finally:
        agent.kill()
