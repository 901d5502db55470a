"""The update flow is read from one table: every state's step does its work and ends in an event, and the
next state is the table's (agent.updates.machine.TRANSITIONS), never the step's. The published status
speaks the machine's states.

Real archives, a real store and the agent's own Updater; the two device-bound pieces of work (the
self-test child, the frames watched on probation) are given as the fleet simulator gives them."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.bundle.archive import pack
from agent.bundle.load import Bundle
from agent.config import UpdatesConfig
from agent.errors import AgentError
from agent.link.prometheus import UPDATE_STATES
from agent.testing import rewrite_manifest
from agent.updates.flow import STEPS, VERDICTS, Outcome
from agent.updates.machine import TERMINAL, TRANSITIONS, Event, State
from agent.updates.probation import ProbationEvidence, ProbationVerdict, judge_probation
from agent.updates.status import LEGACY_STATE, STEP_STATE, VOCABULARY, state_of
from agent.updates.store import BundleStore
from agent.updates.updater import Updater


class _Serving:
    """The serving side as the fleet simulator's SimAgent is: which bundle serves, no engine."""

    def __init__(self, fail_swap: bool = False):
        self.bundle: Bundle | None = None
        self.fail_swap = fail_swap

    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[None]:
        yield

    def swap_bundle(self, bundle: Bundle, candidate: Any, report: dict[str, Any]) -> Bundle | None:
        if self.fail_swap:
            raise AgentError("the engine did not open (simulated)")
        previous, self.bundle = self.bundle, bundle
        return previous

    def restore(self, swap: Bundle | None) -> None:
        self.bundle = swap

    def watch_probation(self, swap: Any, seconds: float, results: int) -> tuple[Any, float]:
        raise AssertionError("probation is given by _Given._probation")

    def stopping(self) -> bool:
        return False


class _Given(Updater):
    """The agent's Updater with the self-test child's report and probation's evidence given."""

    errors = 0
    proven = True

    def _child_selftest(self, root: Path) -> dict[str, Any]:
        return {"passed": self.proven, "reason": None if self.proven else "no candidate passed (given)", "providers": [{"name": "CPUExecutionProvider", "usable": True}],
                "selected": {"provider": "CPUExecutionProvider", "variant": "fp32", "precision": "fp32"},
                "candidates": [{"provider": "CPUExecutionProvider", "variant": "fp32", "options": {}}]}

    def _probation(self, bundle: Bundle, candidate: Any, swap: Any, degraded: bool = False) -> ProbationVerdict:
        return judge_probation(ProbationEvidence(seconds=1.0, frames=20, results=20, refused=0,
                                                 inference_errors=self.errors, non_finite=0, inference_p95_ms=1.0,
                                                 budget_ms=None))


@pytest.fixture(scope="module")
def archives(tiny_bundle_master: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("step-archives")
    out = {}
    for version in (2, 3):
        src = d / f"v{version}"
        shutil.copytree(tiny_bundle_master, src)
        rewrite_manifest(src, lambda m, v=version: m.update(version=v))
        out[f"v{version}"] = pack(src, d / f"v{version}.tar.gz")
    (d / "junk.tar.gz").write_bytes(b"not an archive" * 10)
    out["junk"] = d / "junk.tar.gz"
    return out


@dataclasses.dataclass
class _Rig:
    up: _Given
    agent: _Serving
    docs: list[dict[str, Any]]
    moves: list[tuple[State, Event, State]]  # every transition: (from, event, to)


def _rig(tmp_path: Path, seed: Path, fail_swap: bool = False) -> _Rig:
    store = BundleStore(tmp_path / "store")
    store.import_bundle(seed)  # v1 committed: what a rollback goes back to
    docs: list[dict[str, Any]] = []
    agent = _Serving(fail_swap)
    up = _Given(agent, store, UpdatesConfig(allow_unsigned=True, probation_s=1.0), tmp_path / "state",  # type: ignore[arg-type]
                lambda: None, docs.append)
    moves: list[tuple[State, Event, State]] = []
    fire = up.machine.fire

    def recorded(event: Event, *a: Any, **kw: Any) -> Any:
        before = up.machine.snapshot.state
        snap = fire(event, *a, **kw)
        moves.append((before, event, snap.state))
        return snap

    up.machine.fire = recorded  # type: ignore[method-assign]
    return _Rig(up, agent, docs, moves)


def _install(rig: _Rig, archive: Path, update: str) -> dict[str, Any]:
    assert rig.up.begin(update, "inbox") is None
    return rig.up.install(archive, "inbox", update)


def test_every_state_step_ends_in_an_event_and_the_table_alone_picks_the_next_state(
        tmp_path: Path, tiny_bundle_master: Path, archives: dict[str, Path]) -> None:
    """Each state's step, with each event it can end in: committed, rolled back after the switch (a swap that
    fails, a probation that fails), rejected before it (an archive that does not unpack, a self-test that
    fails), and a rollback."""
    # a step says only which event it ended in: it has no way to name a state
    assert {f.name for f in dataclasses.fields(Outcome)} == {"event", "reason", "bundle"}
    assert set(STEPS) == {s for s in State if s not in TERMINAL}
    assert set(VERDICTS) == TERMINAL - {State.IDLE}

    ok = _rig(tmp_path / "ok", tiny_bundle_master)
    assert _install(ok, archives["v2"], "v2")["state"] == "committed"
    assert ok.up.rollback("back")["state"] == "committed"  # v1 again, verified and proven again
    swap = _rig(tmp_path / "swap", tiny_bundle_master, fail_swap=True)
    assert _install(swap, archives["v2"], "v2")["state"] == "rolled_back"
    bad = _rig(tmp_path / "bad", tiny_bundle_master)
    bad.up.errors = 3
    assert _install(bad, archives["v2"], "v2")["state"] == "rolled_back"
    junk = _rig(tmp_path / "junk", tiny_bundle_master)
    assert _install(junk, archives["junk"], "junk")["state"] == "rejected"
    unproven = _rig(tmp_path / "unproven", tiny_bundle_master)
    unproven.up.proven = False
    assert _install(unproven, archives["v2"], "v2")["state"] == "rejected"

    moves = ok.moves + swap.moves + bad.moves + junk.moves + unproven.moves
    for before, event, after in moves:
        assert TRANSITIONS[before, event] == after, (before, event, after)
    happy = [State.IDLE, State.RECEIVING, State.VERIFYING, State.STAGED, State.PROVING, State.SWITCHING,
             State.PROBATION, State.COMMITTED]
    assert [m[0] for m in ok.moves[:7]] + [ok.moves[6][2]] == happy, ok.moves
    assert ok.moves[7:] == [(State.COMMITTED, Event.ROLLBACK, State.VERIFYING),
                            (State.VERIFYING, Event.VERIFIED, State.STAGED), (State.STAGED, Event.PROVE, State.PROVING),
                            (State.PROVING, Event.PROVEN, State.SWITCHING),
                            (State.SWITCHING, Event.SWITCHED, State.PROBATION),
                            (State.PROBATION, Event.PASSED, State.COMMITTED)], ok.moves
    assert swap.moves[-1] == (State.SWITCHING, Event.FAILED, State.ROLLED_BACK)
    assert bad.moves[-1] == (State.PROBATION, Event.FAILED, State.ROLLED_BACK)
    assert junk.moves[-1] == (State.VERIFYING, Event.REJECT, State.REJECTED)
    assert unproven.moves[-1] == (State.PROVING, Event.REJECT, State.REJECTED)
    # every step ran and every verdict was reached
    assert {m[0] for m in moves} >= set(STEPS) and {m[2] for m in moves} >= set(VERDICTS)
    # a rolled-back update leaves `current` on `committed`; a rollback commits the bundle it went back to
    for rig in (swap, bad):
        assert rig.up.store.current_id == rig.up.store.committed_id and len(rig.up.store.history()) == 1
    assert str(ok.up.store.committed_id).startswith("tiny-classifier-v1-") and len(ok.up.store.history()) == 2


def test_the_published_state_is_always_one_of_the_machines_states(tmp_path: Path, tiny_bundle_master: Path,
                                                                   archives: dict[str, Path]) -> None:
    """Fault: the status said `selftest`, `switched`, `downloading` where the machine said `proving`,
    `switching`, `receiving`: the fleet operator, the pusher and /metrics each kept their own word list."""
    assert set(VOCABULARY) == {s.value for s in State}
    assert UPDATE_STATES == VOCABULARY  # /metrics' state set, spelled in link/ (which may not import updates/)
    assert set(STEP_STATE.values()) == set(State) - {State.IDLE}  # every state is published by a step
    rig = _rig(tmp_path, tiny_bundle_master)
    _install(rig, archives["v2"], "v2")
    rig.up.rollback("back")
    assert rig.docs
    for doc in rig.docs:
        assert doc["state"] in VOCABULARY and doc["state"] == STEP_STATE[doc["step"]].value, doc
        assert doc["phase"] in VOCABULARY, doc
    assert [d["state"] for d in rig.docs if d["update"] == "v2"] == [
        "verifying", "verifying", "staged", "proving", "proving", "switching", "probation", "committed"]
    # a device from before the change still reads: its old words are its states
    assert {w: state_of({"state": w}) for w in ("downloading", "progress", "missing", "unpacking", "verified",
                                                "selftest", "selftest_passed", "switched")} == LEGACY_STATE
    assert state_of({"state": "committed"}) == "committed" and state_of({}) is None


def test_the_fleet_operator_reads_the_new_words_and_the_old_ones_devices_in_the_field_still_send() -> None:
    """A device from before the change says `downloading`, `progress`, `missing`; one after says `receiving`
    (its step one of those): both are counted under the download cap, neither once it proves."""
    from agent.fleet.gates import downloading
    from tests.fleet.test_fleet_gates import plan

    p = plan()
    for doc in ({"state": "receiving", "step": "downloading"}, {"state": "receiving", "step": "progress"},
                {"state": "downloading"}, {"state": "progress"}, {"state": "missing"}, {"state": "receiving"}):
        assert downloading(p, {"update": "r1", **doc}), doc
    for doc in ({"state": "verifying", "step": "unpacking"}, {"state": "proving", "step": "selftest"},
                {"state": "selftest"}, {"state": "unpacking"}, {"state": "committed"}):
        assert not downloading(p, {"update": "r1", **doc}), doc
