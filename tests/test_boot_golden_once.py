"""A cold boot reads each golden array once, in the self-test child: the child's load checks them and keeps
them for its proof (it read all of them twice), and the agent, after the verdict, only hashes the files the
child checked (it read all of them a third time, 25 ms of the demo's cold start, on the critical path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.bundle import load as load_mod
from agent.config import Config
from agent.proof import selftest
from agent.service import boot as boot_mod
from agent.service import selftest_child

DIGITS = Path(__file__).resolve().parents[1] / "models" / "digits-classifier"


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real = load_mod.load_golden

    def load_golden(root, rel, index, manifest):  # the real reader, each read noted
        reads.append(rel)
        return real(root, rel, index, manifest)

    monkeypatch.setattr(load_mod, "load_golden", load_golden)
    return reads


def test_the_agent_reads_no_golden_array_at_boot_and_still_serves(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _counted(monkeypatch)  # this process only: the proof runs in its child
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=DIGITS), None)
    assert outcome.engine is not None, outcome.reason
    assert reads == []
    # the serving audit still reads them, one at a time, from the same bundle
    assert len(list(outcome.bundle.golden_samples())) == len(outcome.bundle.manifest.golden) == len(reads)


def test_the_self_test_child_reads_each_golden_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("detect_providers", "prove", "evaluate", "BEFORE_RUN"):  # the child rebinds these: restored after
        monkeypatch.setattr(selftest, name, getattr(selftest, name))
    reads = _counted(monkeypatch)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DIGITS)}))
    out = tmp_path / "report.json"
    rc = selftest_child.main(["--bundle", str(DIGITS), "--state-dir", str(tmp_path / "state"), "--out", str(out),
                              "--config", str(cfg), "--no-cache"])
    assert rc == 0
    golden = yaml.safe_load((DIGITS / "bundle.yaml").read_text())["golden"]
    assert sorted(reads) == sorted(golden), reads
