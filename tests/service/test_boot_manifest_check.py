"""After the child's verdict the boot reads and hash-checks the bundle itself, and serves it only if the
manifest it read is the one the child proved."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.config import Config
from agent.errors import BundleError
from agent.proof.isolation import ChildProof
from agent.service import boot as boot_mod

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def _proved(report_bundle: dict) -> ChildProof:
    return ChildProof({"passed": True, "bundle": report_bundle,
                       "selected": {"provider": "CPUExecutionProvider", "variant": "fp32", "precision": "fp32"}}, None)


def test_a_bundle_whose_manifest_is_not_the_one_proven_does_not_serve(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The child proved another manifest (the bundle was replaced during the proof): before, the boot read
    the bundle after the verdict and served whatever was there then."""
    root = tmp_path / "bundle"
    shutil.copytree(DIGITS, root)
    monkeypatch.setattr(boot_mod, "prove", lambda r, cfg, use_cache=True: _proved({"manifest_sha256": "0" * 64}))
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=root), None)
    assert outcome.engine is None and outcome.reason is not None, outcome
    assert "changed while it was proven" in outcome.reason and "nothing unproven serves" in outcome.reason


def test_a_load_error_after_the_verdict_is_the_boots_reason(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "bundle"
    shutil.copytree(DIGITS, root)
    seen = []

    def load(r: Path, **kw: bool):
        seen.append("load")
        raise BundleError(f"{r}: model_fp32.onnx hash mismatch")

    def prove(r: Path, cfg, use_cache: bool = True) -> ChildProof:
        seen.append("prove")
        return _proved({"manifest_sha256": "x"})

    monkeypatch.setattr(boot_mod, "load_bundle", load)
    monkeypatch.setattr(boot_mod, "prove", prove)
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=root), None)
    assert outcome.engine is None and "hash mismatch" in (outcome.reason or ""), outcome
    assert seen == ["prove", "load"], "the agent loads only after the child survived loading"


def test_a_proven_unchanged_bundle_serves(tmp_path: Path) -> None:
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=DIGITS), None)
    assert outcome.reason is None and outcome.engine is not None and outcome.bundle is not None, outcome.reason
    assert (outcome.report or {})["bundle"]["manifest_sha256"] == outcome.bundle.manifest_sha256
