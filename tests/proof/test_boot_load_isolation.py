"""Loading the bundle is a step the self-test child is isolated for (`mark_step("load")`): a bundle whose
load kills a process (a native fault, the OOM killer on its golden arrays, a hang) must kill the child,
be recorded against "load", and be refused: never loaded in the agent's own process first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.config import Config
from agent.proof.isolation import CrashLedger, bundle_digest
from agent.service import boot as boot_mod

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def test_a_bundle_whose_load_crashed_the_child_is_not_loaded_by_the_agent(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "bundle"
    shutil.copytree(DIGITS, root)
    state = tmp_path / "state"
    (state / "selftest").mkdir(parents=True)
    CrashLedger(state / "selftest").record("load", bundle_digest(root), "SIGSEGV")
    loaded = []
    monkeypatch.setattr(boot_mod, "load_bundle", lambda r, **kw: loaded.append(r))
    outcome = boot_mod.boot(Config(state_dir=state, bundle=root), None)
    assert outcome.engine is None and "loading the bundle" in (outcome.reason or ""), outcome
    assert loaded == [], "the agent loaded a bundle whose load is recorded as killing a process"


def test_the_agent_loads_the_bundle_only_after_the_child_has_loaded_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's death in "load" must not take the agent with it: nothing of the bundle is read here
    before the child's verdict."""
    root = tmp_path / "bundle"
    shutil.copytree(DIGITS, root)
    order = []
    monkeypatch.setattr(boot_mod, "load_bundle", lambda r, **kw: order.append("load")
                        or (_ for _ in ()).throw(boot_mod.AgentError("stop here")))

    def prove(r, cfg, use_cache=True):
        import time
        time.sleep(0.2)  # the child's load, and its proof
        order.append("verdict")
        return boot_mod.ChildProof(None, "the child died in load (SIGKILL)")

    monkeypatch.setattr(boot_mod, "prove", prove)
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=root), None)
    assert outcome.reason == "the child died in load (SIGKILL)"
    assert order == ["verdict"], order
