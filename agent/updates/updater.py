"""Updates: a pushed bundle is verified, self-tested on this device in a child process, switched in
atomically, watched on probation, then committed, or rolled back. The old bundle serves until then.

How a bundle arrives (MQTT chunks, a URL, an inbox) is agent.updates.delivery's job; what each state does
is its step in agent.updates.flow; this module is the driver that runs the steps through the machine's
table, and the API the deliveries and the controller call. Every step is logged and published on
`update/status` in the machine's words (agent.updates.status).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from agent.bundle.load import Bundle
from agent.config import UpdatesConfig
from agent.errors import AgentError, Busy, UpdateRejected
from agent.logsetup import get_logger
from agent.proof.isolation import prove_in_child
from agent.proof.verdict import Candidate
from agent.updates.flow import STEPS, VERDICTS, Run, file_kind
from agent.updates.machine import BEFORE_SWITCH, TERMINAL, TRANSITIONS, Event, Snapshot, State, UpdateMachine
from agent.updates.probation import ProbationEvidence, ProbationVerdict, judge_probation, p95
from agent.updates.status import status_doc
from agent.updates.store import BundleStore

__all__ = ["Busy", "ServingAgent", "UpdateRejected", "Updater", "file_kind"]  # what deliveries and the simulator import

log = get_logger("updates")


class ServingAgent(Protocol):
    """What the updater needs from the controller that owns the serving state."""

    @property
    def bundle(self) -> Bundle | None: ...

    def operation(self, name: str) -> ContextManager[None]: ...
    def swap_bundle(self, bundle: Bundle, candidate: Candidate, report: dict[str, Any]) -> Any: ...
    def restore(self, swap: Any) -> None: ...
    def watch_probation(self, swap: Any, seconds: float, results: int) -> tuple[Any, float]: ...
    def stopping(self) -> bool: ...


class Updater:
    """Runs an update through the machine's states. Deliveries hand it archives; the machine is the guard."""

    def __init__(self, agent: ServingAgent, store: BundleStore, cfg: UpdatesConfig, state_dir: Path,
                 serving_config: Callable[[], Any], publish: Callable[[dict[str, Any]], None],
                 machine: UpdateMachine | None = None,
                 on_owner: Callable[[Callable[[], Any]], Any] | None = None):
        self.agent, self.store, self.cfg = agent, store, cfg
        # the config object that serves (the controller's, after any reload): the update's proof runs under
        # exactly it, never under a file re-read from disk or defaults for a config built in code
        self.serving_config = serving_config
        self.state_dir, self.publish = state_dir, publish
        self.machine = machine or UpdateMachine(store.root)
        # runs a transition on the thread that owns the update (the controller's); inline without one
        self.on_owner: Callable[[Callable[[], Any]], Any] = on_owner or (lambda fn: fn())
        if cfg.allow_unsigned:
            log.warning("updates.unsigned_allowed", detail="UNSIGNED BUNDLES ARE ACCEPTED (updates.allow_unsigned)")

    def _fire(self, event: Event, *args: Any, **kw: Any) -> Snapshot:
        """Every transition runs on the owner's thread (the controller's queue), whichever thread asks."""
        snap: Snapshot = self.on_owner(lambda: self.machine.fire(event, *args, **kw))
        return snap

    # -- status ------------------------------------------------------------------------------------------
    def status(self, update: str, origin: str, step: str, **detail: Any) -> dict[str, Any]:
        """Publish one status: `step` is its word (agent.updates.status.STEP_STATE), `state` the machine's."""
        doc = status_doc(update, origin, step, self.machine.snapshot.state, **detail)
        (log.warning if step in ("rejected", "rolled_back") else log.info)("update." + step, update=update, **detail)
        self.publish(doc)
        return doc

    def begin(self, update: str, origin: str, offer: bool = False) -> str | None:
        """A delivery starts receiving; the reason it may not (another update holds the machine), or None."""
        try:
            self._fire(Event.OFFER if offer else Event.BEGIN, update, origin)
        except Busy as exc:
            return str(exc)
        return None

    def refuse(self, update: str, origin: str, reason: str) -> dict[str, Any]:
        """A verdict of `rejected`: the machine moves to Rejected when this update holds it before the switch."""
        snap = self.machine.snapshot
        if snap.update == update and snap.origin == origin and snap.state in BEFORE_SWITCH:
            try:
                self._fire(Event.REJECT, reason=reason, expect=update, expect_origin=origin)
            except Busy:
                pass
        return self.status(update, origin, "rejected", reason=reason)

    # -- the flow: one driver over the steps (agent.updates.flow) ----------------------------------------
    def install(self, archive: Path, origin: str, update: str, expected_sha256: str | None = None) -> dict[str, Any]:
        """The archive of an update that `begin` let in is complete: verify, prove, switch, probation."""
        run = Run(update, origin, archive=archive, expected_sha256=expected_sha256)
        try:
            self._advance(run, State.RECEIVING)
        except Busy as exc:  # superseded (a newer offer, a rollback) while it was arriving
            return self.status(update, origin, "rejected", reason=str(exc))
        # An update is a state of the controller: no reload (which re-reads the store) runs meanwhile.
        with self.agent.operation(f"update {update}"):
            run.work = self.store.new_staging("update-")
            try:
                return self.drive(run, State.VERIFYING)
            finally:
                shutil.rmtree(run.work, ignore_errors=True)

    def rollback(self, update: str) -> dict[str, Any]:
        """Go back to the previous committed bundle: verified and self-tested again, then switched.
        Allowed while a delivery is still receiving (it is cancelled), busy from verifying to probation."""
        busy = self.begin_rollback(update)
        if busy is not None:
            return self.status(update, "rollback", "rejected", reason=busy)
        return self.rollback_started(update)

    def begin_rollback(self, update: str) -> str | None:
        """The machine takes a rollback (cancelling a delivery that is still receiving), or says why not."""
        held = self.machine.snapshot
        try:
            self._fire(Event.ROLLBACK, update, "rollback")
        except Busy as exc:
            return str(exc)
        if held.state == State.RECEIVING:
            log.warning("update.cancelled_by_rollback", update=held.update, origin=held.origin)
        return None

    def rollback_started(self, update: str) -> dict[str, Any]:
        """The rollback once the machine took it (the controller fires ROLLBACK on its thread)."""
        with self.agent.operation(f"rollback {update}"):
            return self.drive(Run(update, "rollback"), State.VERIFYING)

    def drive(self, run: Run, state: State) -> dict[str, Any]:
        """Run each state's step and fire its event until a terminal state, whose step publishes the verdict.
        The table alone picks the next state; a step that raises ends the update by the table too."""
        while state not in TERMINAL:
            try:
                snap = self._advance(run, state)
            except AgentError as exc:  # bundle, archive, signature errors all name the problem
                return self._failed(run, str(exc))
            except Exception as exc:  # a bug or an OS error is a verdict too, never a dead delivery path
                log.exception("update.failed", update=run.update)
                return self._failed(run, f"{type(exc).__name__}: {exc}")
            state, run.reason = snap.state, snap.reason
        return VERDICTS[state](self, run)

    def _advance(self, run: Run, state: State) -> Snapshot:
        """One state's step, then its event through the table (Busy when another update took the machine)."""
        out = STEPS[state](self, run)
        return self._fire(out.event, bundle=out.bundle, reason=out.reason, expect=run.update, expect_origin=run.origin)

    def _failed(self, run: Run, reason: str) -> dict[str, Any]:
        """A step raised: `failed` where the state takes it (after the switch; `current` goes back to what was
        committed first), else `reject`; a superseded update is answered rejected without moving the machine."""
        snap = self.machine.snapshot
        if snap.update == run.update and snap.origin == run.origin and (snap.state, Event.FAILED) in TRANSITIONS:
            self.store.revert_current()
            self._fire(Event.FAILED, reason=reason, expect=run.update, expect_origin=run.origin)
            run.reason = reason
            return VERDICTS[State.ROLLED_BACK](self, run)
        return self.refuse(run.update, run.origin, reason)

    # -- the two device-bound steps' work (the fleet simulator draws them instead) -------------------------
    def _child_selftest(self, root: Path) -> dict[str, Any]:
        """The same self-test as boot, in a child process: a crashing provider cannot kill the agent;
        a step that crashes the child is recorded and skipped by the next child."""
        proof = prove_in_child(root, self.state_dir / "update-selftest", self.serving_config(),
                               self.cfg.selftest_timeout_s, use_cache=False,
                               records_dir=self.state_dir / "selftest")  # the boot's ledger: one truth
        for crash in proof.crashes:
            log.error("update.selftest_step_crashed", step=crash.step, signal=crash.signal)
        if proof.report is None:
            raise UpdateRejected(f"self-test on this device: {proof.error}; the agent kept serving")
        return proof.report

    def _probation(self, bundle: Bundle, candidate: Candidate, swap: Any, degraded: bool = False) -> ProbationVerdict:
        """The controller's tick watches what the new engine serves (N seconds or frames, a first error, a
        shutdown); this thread only waits for its word. The judging is `judge_probation`."""
        tally, seconds = self.agent.watch_probation(swap, self.cfg.probation_s, self.cfg.probation_frames)
        return judge_probation(ProbationEvidence(
            seconds=round(seconds, 3), frames=tally.frames, results=tally.results,
            refused=tally.refused, inference_errors=tally.inference_errors, non_finite=tally.non_finite,
            post_refused=tally.post_refused,
            inference_p95_ms=p95(list(tally.inference_ms)),
            budget_ms=bundle.manifest.selftest.budget_for(candidate.provider),
            when_too_slow="degraded" if degraded else "none"))
