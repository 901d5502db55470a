"""The serving-evidence ledger (agent/proof/evidence.py) and the choice of the next proven candidate
(agent/service/evidence.py): real files in a state dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.proof.evidence import EvidenceLedger
from agent.service.evidence import next_proven


def test_evidence_applies_per_bundle_until_it_expires_and_survives_a_new_ledger(tmp_path: Path) -> None:
    ledger = EvidenceLedger(tmp_path)
    rec = ledger.record("sha-a", "CPU:int8", "canary", "reproduction: max abs 0.5 > 0.01", ttl_s=60)
    assert set(EvidenceLedger(tmp_path).active("sha-a")) == {"CPU:int8"}  # read back from the file
    assert EvidenceLedger(tmp_path).active("sha-b") == {}  # another bundle starts clean
    assert EvidenceLedger(tmp_path).active("sha-a", now=rec.expires + 1) == {}
    assert "disproven while serving: canary check" in rec.describe() and "--forget-evidence" in rec.describe()


def test_a_damaged_file_reads_as_no_evidence(tmp_path: Path) -> None:
    (tmp_path / "disproven.json").write_text("7")
    assert EvidenceLedger(tmp_path).active("sha") == {}
    (tmp_path / "disproven.json").write_text('[{"bundle": "sha"}]')
    assert EvidenceLedger(tmp_path).active("sha") == {}


def test_the_operator_clears_it_with_selftest_forget_evidence(tmp_path: Path) -> None:
    EvidenceLedger(tmp_path / "selftest").record("sha", "CPU:int8", "live", "top-1 agreement 0.0 < 0.9", 60)
    out = subprocess.run([sys.executable, "-m", "agent", "selftest", "--forget-evidence", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "forgot 1 serving evidence record(s)" in out.stderr
    assert EvidenceLedger(tmp_path / "selftest").active("sha") == {}


def test_the_next_proven_candidate_is_the_first_passing_one_not_excluded() -> None:
    report = {"candidates": [
        {"provider": "CPU", "variant": "int8", "precision": "int8", "passed": True},
        {"provider": "CPU", "variant": "fp16", "precision": "fp16", "passed": False},
        {"provider": "CPU", "variant": "fp32", "precision": "fp32", "passed": True, "options": {"a": "1"}},
    ]}
    found = next_proven(report, {"CPU:int8"})
    assert found is not None and found[0].key == "CPU:fp32" and dict(found[0].options) == {"a": "1"}
    assert next_proven(report, {"CPU:int8", "CPU:fp32"}) is None
    assert next_proven(None, set()) is None
