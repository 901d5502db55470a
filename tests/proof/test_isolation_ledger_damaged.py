"""A damaged crash ledger (`<state_dir>/selftest/crashes.json` unreadable or unwritable) must never stop
the proof: the boot's proof used to raise out of `boot()` (TypeError, IsADirectoryError), so the
controller's boot job died before READY and the agent sat neither serving nor saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import Config
from agent.proof.isolation import CrashLedger, prove_in_child
from agent.service.boot import boot

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "models" / "digits-classifier"
INT8 = "candidate:CPUExecutionProvider:int8"


@pytest.mark.parametrize("content", ["7", "true", "{\"step\": 1}", "[1, \"x\", null]", "\x00\x01garbage"])
def test_a_corrupted_ledger_is_read_as_empty_and_the_boot_serves(tmp_path: Path, content: str) -> None:
    cfg = Config(state_dir=tmp_path / "state", bundle=DIGITS)
    d = cfg.state_dir / "selftest"
    d.mkdir(parents=True)
    (d / "crashes.json").write_text(content)
    assert CrashLedger(d).active("sha") == {}
    outcome = boot(cfg, None)
    assert outcome.engine is not None, outcome.reason


def test_an_unwritable_ledger_still_skips_the_crashed_candidate_in_this_proof(tmp_path: Path) -> None:
    cfg = Config(state_dir=tmp_path / "state", bundle=DIGITS)
    d = cfg.state_dir / "selftest"
    (d / "crashes.json").mkdir(parents=True)  # a path nothing can replace (even as root): every write fails
    proof = prove_in_child(DIGITS, cfg.state_dir, cfg, 300, use_cache=False,
                           env={"EDGE_AGENT_FAULT": f"{INT8}=SIGSEGV"})
    assert proof.passed, proof.error or proof.reason
    assert proof.report is not None and proof.report["selected"]["variant"] == "fp32"
    assert [c.step for c in proof.crashes] == [INT8]
