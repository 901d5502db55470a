"""Updates: a pushed bundle is verified, self-tested on this device in a child process, switched in
atomically, watched on probation, then committed, or rolled back. The old bundle serves until then.

How a bundle arrives (MQTT chunks, a URL, an inbox) is agent.updates.delivery's job; every step is
logged and published on `update/status`.
"""

from __future__ import annotations

import dataclasses
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from agent import __version__
from agent.bundle.archive import UnpackLimits, unpack_signed
from agent.bundle.load import Bundle, load_bundle
from agent.config import UpdatesConfig
from agent.errors import AgentError, UpdateRejected
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.bundle.signing import verify_signature
from agent.proof.isolation import prove_in_child
from agent.proof.overall import proof_verdict
from agent.proof.verdict import Candidate
from agent.updates.probation import ProbationEvidence, ProbationVerdict, judge_probation, p95
from agent.updates.machine import AFTER_SWITCH, BEFORE_SWITCH, Busy, Event, Snapshot, State, UpdateMachine
from agent.updates.store import BundleStore

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


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


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
        return self.on_owner(lambda: self.machine.fire(event, *args, **kw))

    # -- status ------------------------------------------------------------------------------------------
    def status(self, update: str, origin: str, state: str, **detail: Any) -> dict[str, Any]:
        doc = {"update": update, "origin": origin, "state": state, "ts": round(time.time(), 3),
               "phase": self.machine.snapshot.state.value, **detail}
        (log.warning if state in ("rejected", "rolled_back") else log.info)("update." + state, update=update, **detail)
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

    # -- the install flow --------------------------------------------------------------------------------
    def install(self, archive: Path, origin: str, update: str, expected_sha256: str | None = None) -> dict[str, Any]:
        """The archive of an update that `begin` let in is complete: verify, prove, switch, probation."""
        try:
            self._fire(Event.RECEIVED, expect=update, expect_origin=origin)
        except Busy as exc:  # superseded (a newer offer, a rollback) while it was arriving
            return self.status(update, origin, "rejected", reason=str(exc))
        # An update is a state of the controller: no reload (which re-reads the store) runs meanwhile.
        with self.agent.operation(f"update {update}"):
            work = self.store.new_staging("update-")
            try:
                return self._install(archive, origin, update, expected_sha256, work)
            except AgentError as exc:  # bundle, archive, signature errors all name the problem
                return self._failed(update, origin, str(exc))
            except Exception as exc:  # a bug or an OS error is a verdict too, never a dead delivery path
                log.exception("update.failed", update=update)
                return self._failed(update, origin, f"{type(exc).__name__}: {exc}")
            finally:
                shutil.rmtree(work, ignore_errors=True)

    def _failed(self, update: str, origin: str, reason: str) -> dict[str, Any]:
        snap = self.machine.snapshot
        if snap.update == update and snap.origin == origin and snap.state in AFTER_SWITCH:
            # an error after the switch: whatever serves, `current` goes back to what was committed
            self.store.revert_current()
            self._fire(Event.FAILED, reason=reason, expect=update, expect_origin=origin)
            return self.status(update, origin, "rolled_back", reason=reason)
        return self.refuse(update, origin, reason)

    def _install(self, archive: Path, origin: str, update: str, expected_sha256: str | None,
                 work: Path) -> dict[str, Any]:
        self.status(update, origin, "verifying")
        st = archive.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise UpdateRejected(f"{archive.name}: not a regular file ({file_kind(st.st_mode)}); refused before opening")
        if st.st_size > self.cfg.max_bundle_bytes:
            raise UpdateRejected(f"archive is {st.st_size} bytes, over updates.max_bundle_bytes {self.cfg.max_bundle_bytes}")
        if expected_sha256 is not None:
            actual = sha256_file(archive)
            if actual != expected_sha256:
                raise UpdateRejected(f"hash mismatch: archive sha256 {actual[:16]}..., expected {expected_sha256[:16]}...")
        self.status(update, origin, "unpacking")
        # signature first: nothing is written before bundle.yaml verifies; each member is hashed as it lands
        root, sig = unpack_signed(archive, work / "bundle", UnpackLimits(max_member_bytes=self.cfg.max_bundle_bytes,
                                  max_total_bytes=self.cfg.max_bundle_bytes), self.cfg.trusted_keys, self.cfg.allow_unsigned)
        if not sig.signed:
            log.warning("update.unsigned_accepted", update=update, detail="no signature; allowed by config")
        bundle = load_bundle(root, check_contracts=False)  # the self-test child opens every variant
        self._check_version_and_compatibility(bundle)
        self._fire(Event.VERIFIED, expect=update, expect_origin=origin)
        self.status(update, origin, "verified", bundle=bundle.identity, key_id=sig.key_id)

        return self._prove_and_switch(update, origin, root, bundle, stored_id=None)

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
            try:
                prev = self.store.previous_committed()
                if prev is None:
                    raise UpdateRejected("no previous committed bundle in the store")
                root = self.store.path(prev)
                seeded = self.store.seed_sha256(prev)  # the operator's own seed needs no signature ...
                if seeded is None:
                    verify_signature(root, self.cfg.trusted_keys, self.cfg.allow_unsigned)
                bundle = load_bundle(root, check_contracts=False)  # the child checks the contracts
                if seeded is not None and bundle.manifest_sha256 != seeded:  # ... but must be what was installed
                    raise UpdateRejected(f"{root}: the seeded bundle changed on disk since it was installed")
                self._fire(Event.VERIFIED, expect=update, expect_origin="rollback")
                self.status(update, "rollback", "verified", bundle=bundle.identity)
                return self._prove_and_switch(update, "rollback", root, bundle, stored_id=prev)
            except AgentError as exc:
                return self._failed(update, "rollback", str(exc))
            except Exception as exc:
                log.exception("update.failed", update=update)
                return self._failed(update, "rollback", f"{type(exc).__name__}: {exc}")

    def _prove_and_switch(self, update: str, origin: str, root: Path, bundle: Bundle,
                          stored_id: str | None) -> dict[str, Any]:
        self._fire(Event.PROVE, expect=update, expect_origin=origin)
        self.status(update, origin, "selftest")
        report = self._child_selftest(root)
        if not report.get("passed"):
            raise UpdateRejected(f"self-test failed on this device: {report.get('reason')}")
        wanted = set(bundle.manifest.requires.get("providers", []))
        usable = {p["name"] for p in report.get("providers", []) if p.get("usable")}
        if wanted and not wanted & usable:
            raise UpdateRejected(f"bundle requires one of {sorted(wanted)}; usable here: {sorted(usable)}")
        sel = report["selected"]
        candidate = Candidate(sel["provider"], sel["variant"], sel["precision"],
                              next((c.get("options") or {} for c in report["candidates"]
                                    if c["provider"] == sel["provider"] and c["variant"] == sel["variant"]), {}))
        proof = proof_verdict(report)  # a degraded proof says so in every status (push prints them), never "pass"
        loud = {"degraded": report.get("degraded") or "pinned below its floor"} if proof == "degraded" else {}
        self.status(update, origin, "selftest_passed", selected=f"{candidate.provider}:{candidate.variant}",
                    verdict=proof, **loud)

        bid = stored_id or self.store.add(root, bundle)
        # recorded before `current` moves: a power cut from here on is rolled back at boot
        self._fire(Event.PROVEN, bundle=bid, expect=update, expect_origin=origin)
        # verified in staging and moved by rename: same files, new root; no second hashing pass
        stored = dataclasses.replace(bundle, root=self.store.path(bid))
        self.store.activate(bid)
        self.status(update, origin, "switched", bundle=bid)
        try:
            swap = self.agent.swap_bundle(stored, candidate, report)
        except AgentError as exc:
            self.store.revert_current()
            reason = f"could not start serving it: {exc}"
            self._fire(Event.FAILED, reason=reason, expect=update, expect_origin=origin)
            return self.status(update, origin, "rolled_back", reason=reason)
        self._fire(Event.SWITCHED, expect=update, expect_origin=origin)
        self.status(update, origin, "probation", seconds=self.cfg.probation_s, frames=self.cfg.probation_frames)
        try:
            verdict = self._probation(stored, candidate, swap, degraded=bool(report.get("degraded")))
        except Exception:
            self.agent.restore(swap)
            raise
        e = verdict.evidence
        cut_short = (self.agent.stopping() and e.results < self.cfg.probation_frames
                     and e.seconds < self.cfg.probation_s)
        if not verdict.passed or cut_short:
            # a probation the shutdown cut short proved nothing: the committed bundle serves at the next start
            reason = (verdict.summary if not verdict.passed else
                      f"probation cut short by shutdown after {e.seconds:.1f} s and {e.results} results "
                      f"(needs {self.cfg.probation_s:g} s or {self.cfg.probation_frames} results): not committed")
            self.agent.restore(swap)
            self.store.revert_current()
            self._fire(Event.FAILED, reason=reason, expect=update, expect_origin=origin)
            return self.status(update, origin, "rolled_back", reason=reason, bundle=bid,
                               probation=verdict.to_dict())
        self.store.commit(bid)
        self._fire(Event.PASSED, reason=verdict.summary, expect=update, expect_origin=origin)
        removed = self.store.prune(self.cfg.keep)
        return self.status(update, origin, "committed", bundle=bid, probation=verdict.to_dict(), verdict=proof,
                           detail=verdict.summary, pruned=removed)

    def _check_version_and_compatibility(self, bundle: Bundle) -> None:
        """Anti-downgrade (only `rollback` goes back, and it does not come through here) and requires.agent."""
        active = self.agent.bundle
        m = bundle.manifest
        if active is not None:
            a = active.manifest
            if m.name == a.name and m.version <= a.version:
                raise UpdateRejected(f"version {m.version} is not newer than the active {a.name} version {a.version} "
                                     "(anti-downgrade; use the rollback command to go back)")
        need = m.requires.get("agent")
        if need and _version_tuple(__version__) < _version_tuple(need):
            raise UpdateRejected(f"bundle requires agent >= {need}, this agent is {__version__}")

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
