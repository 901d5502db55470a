"""The update flow as steps: each state of the machine has one step, which does that state's work on entry
and returns the event it ends with; `drive` fires that event and the table alone picks the next state.

  receiving  the delivery's (agent.updates.delivery): its archive is complete   -> received
  verifying  size, hash, signature, unpack, manifest, anti-downgrade            -> verified
             (a rollback: the stored bundle's signature or seed hash, again)
  staged     published with its identity and key                               -> prove
  proving    the self-test child under the serving config, stored on a pass     -> proven
  switching  `current` moves, the engine is swapped in                          -> switched | failed
  probation  the controller's tick watches it, the judge decides, committed     -> passed | failed
  committed, rolled_back, rejected: terminal; their step publishes the verdict

A step that raises ends the update by the table too: `failed` where the state takes it (after the switch:
`current` goes back to `committed`), else `reject`. Every state is persisted on entry (machine.fire writes
store/update.json before the step runs): each non-terminal state must be resolved after a power cut, and
which bundle serves is decided by the store's symlinks, which each step moves before its event is fired.
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agent import __version__
from agent.bundle.archive import UnpackLimits, unpack_signed
from agent.bundle.load import Bundle, load_bundle
from agent.bundle.signing import verify_signature
from agent.errors import AgentError, UpdateRejected
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.proof.overall import proof_verdict
from agent.proof.verdict import Candidate
from agent.updates.machine import Event, State

if TYPE_CHECKING:
    from agent.updates.updater import Updater

log = get_logger("updates")


@dataclass
class Run:
    """One update on its way through the states: what its delivery handed over and what each step found."""

    update: str
    origin: str                          # mqtt, url, inbox, rollback
    archive: Path | None = None          # a delivery's archive; None for a rollback (the store's bundle)
    expected_sha256: str | None = None
    work: Path | None = None             # the staging directory the archive is unpacked into
    root: Path | None = None             # the verified bundle's directory
    bundle: Bundle | None = None
    key_id: str | None = None
    stored_id: str | None = None         # a rollback's bundle, already in the store
    report: dict[str, Any] = field(default_factory=dict)
    candidate: Candidate | None = None
    proof: str = "pass"                  # the proof's verdict: pass or degraded
    bid: str | None = None               # the store id once stored
    swap: Any = None                     # what the controller's `restore` puts back
    reason: str | None = None            # the terminal verdict's reason
    verdict: dict[str, Any] = field(default_factory=dict)  # the terminal status's fields

    @property
    def rollback(self) -> bool:
        return self.archive is None


@dataclass(frozen=True)
class Outcome:
    """What a step ends with: the event the driver fires, and what the event records."""

    event: Event
    reason: str | None = None
    bundle: str | None = None


Step = Callable[["Updater", Run], Outcome]


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


# -- the steps ---------------------------------------------------------------------------------------------
def receiving(up: Updater, run: Run) -> Outcome:
    """The delivery received the archive (chunks, a download, an inbox file): it hands it over complete."""
    return Outcome(Event.RECEIVED)


def verifying(up: Updater, run: Run) -> Outcome:
    """A delivered archive: bounded, hashed, its signature first, unpacked, its manifest and version checked.
    A rollback: the previous committed bundle's signature (or the operator's seed hash) again."""
    return _verify_stored(up, run) if run.rollback else _verify_archive(up, run)


def _verify_archive(up: Updater, run: Run) -> Outcome:
    archive, cfg = run.archive, up.cfg
    assert archive is not None and run.work is not None
    up.status(run.update, run.origin, "verifying")
    st = archive.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise UpdateRejected(f"{archive.name}: not a regular file ({file_kind(st.st_mode)}); refused before opening")
    if st.st_size > cfg.max_bundle_bytes:
        raise UpdateRejected(f"archive is {st.st_size} bytes, over updates.max_bundle_bytes {cfg.max_bundle_bytes}")
    if run.expected_sha256 is not None:
        actual = sha256_file(archive)
        if actual != run.expected_sha256:
            raise UpdateRejected(f"hash mismatch: archive sha256 {actual[:16]}..., expected {run.expected_sha256[:16]}...")
    up.status(run.update, run.origin, "unpacking")
    # signature first: nothing is written before bundle.yaml verifies; each member is hashed as it lands
    root, sig = unpack_signed(archive, run.work / "bundle", UnpackLimits(max_member_bytes=cfg.max_bundle_bytes,
                              max_total_bytes=cfg.max_bundle_bytes), cfg.trusted_keys, cfg.allow_unsigned)
    if not sig.signed:
        log.warning("update.unsigned_accepted", update=run.update, detail="no signature; allowed by config")
    bundle = load_bundle(root, check_contracts=False)  # the self-test child opens every variant
    _check_version_and_compatibility(up, bundle)
    run.root, run.bundle, run.key_id = root, bundle, sig.key_id
    return Outcome(Event.VERIFIED)


def _verify_stored(up: Updater, run: Run) -> Outcome:
    prev = up.store.previous_committed()
    if prev is None:
        raise UpdateRejected("no previous committed bundle in the store")
    root = up.store.path(prev)
    seeded = up.store.seed_sha256(prev)  # the operator's own seed needs no signature ...
    if seeded is None:
        verify_signature(root, up.cfg.trusted_keys, up.cfg.allow_unsigned)
    bundle = load_bundle(root, check_contracts=False)  # the child checks the contracts
    if seeded is not None and bundle.manifest_sha256 != seeded:  # ... but must be what was installed
        raise UpdateRejected(f"{root}: the seeded bundle changed on disk since it was installed")
    run.root, run.bundle, run.stored_id = root, bundle, prev
    return Outcome(Event.VERIFIED)


def _check_version_and_compatibility(up: Updater, bundle: Bundle) -> None:
    """Anti-downgrade (only `rollback` goes back, and it does not come through here) and requires.agent."""
    active = up.agent.bundle
    m = bundle.manifest
    if active is not None:
        a = active.manifest
        if m.name == a.name and m.version <= a.version:
            raise UpdateRejected(f"version {m.version} is not newer than the active {a.name} version {a.version} "
                                 "(anti-downgrade; use the rollback command to go back)")
    need = m.requires.get("agent")
    if need and _version_tuple(__version__) < _version_tuple(need):
        raise UpdateRejected(f"bundle requires agent >= {need}, this agent is {__version__}")


def staged(up: Updater, run: Run) -> Outcome:
    assert run.bundle is not None
    key = {} if run.rollback else {"key_id": run.key_id}
    up.status(run.update, run.origin, "verified", bundle=run.bundle.identity, **key)
    return Outcome(Event.PROVE)


def proving(up: Updater, run: Run) -> Outcome:
    """The same self-test as boot, in a child under the serving config; on a pass the bundle is stored."""
    assert run.root is not None and run.bundle is not None
    up.status(run.update, run.origin, "selftest")
    report = up._child_selftest(run.root)
    if not report.get("passed"):
        raise UpdateRejected(f"self-test failed on this device: {report.get('reason')}")
    wanted = set(run.bundle.manifest.requires.get("providers", []))
    usable = {p["name"] for p in report.get("providers", []) if p.get("usable")}
    if wanted and not wanted & usable:
        raise UpdateRejected(f"bundle requires one of {sorted(wanted)}; usable here: {sorted(usable)}")
    sel = report["selected"]
    candidate = Candidate(sel["provider"], sel["variant"], sel["precision"],
                          next((c.get("options") or {} for c in report["candidates"]
                                if c["provider"] == sel["provider"] and c["variant"] == sel["variant"]), {}))
    proof = proof_verdict(report)  # a degraded proof says so in every status (push prints them), never "pass"
    loud = {"degraded": report.get("degraded") or "pinned below its floor"} if proof == "degraded" else {}
    up.status(run.update, run.origin, "selftest_passed", selected=f"{candidate.provider}:{candidate.variant}",
              verdict=proof, **loud)
    run.report, run.candidate, run.proof = report, candidate, proof
    # stored before `current` moves; PROVEN records its id: a power cut from here on is rolled back at boot
    bid = run.stored_id or up.store.add(run.root, run.bundle)
    return Outcome(Event.PROVEN, bundle=bid)


def switching(up: Updater, run: Run) -> Outcome:
    """`current` moves, then the controller swaps the engine in; a swap that fails puts `current` back."""
    bid = up.machine.snapshot.bundle
    assert bid is not None and run.bundle is not None and run.candidate is not None
    # verified in staging and moved by rename: same files, new root; no second hashing pass
    run.bid, run.bundle = bid, dataclasses.replace(run.bundle, root=up.store.path(bid))
    up.store.activate(bid)
    up.status(run.update, run.origin, "switched", bundle=bid)
    try:
        run.swap = up.agent.swap_bundle(run.bundle, run.candidate, run.report)
    except AgentError as exc:
        up.store.revert_current()
        return Outcome(Event.FAILED, reason=f"could not start serving it: {exc}")
    return Outcome(Event.SWITCHED)


def probation(up: Updater, run: Run) -> Outcome:
    """The new bundle serves; the controller's tick watches it and the judge decides. Committed on a pass;
    a failure, or a probation the shutdown cut short (it proved nothing), puts the committed bundle back."""
    cfg = up.cfg
    assert run.bundle is not None and run.candidate is not None and run.bid is not None
    up.status(run.update, run.origin, "probation", seconds=cfg.probation_s, frames=cfg.probation_frames)
    try:
        verdict = up._probation(run.bundle, run.candidate, run.swap, degraded=bool(run.report.get("degraded")))
    except Exception:
        up.agent.restore(run.swap)
        raise
    e = verdict.evidence
    cut_short = up.agent.stopping() and e.results < cfg.probation_frames and e.seconds < cfg.probation_s
    if not verdict.passed or cut_short:
        reason = (verdict.summary if not verdict.passed else
                  f"probation cut short by shutdown after {e.seconds:.1f} s and {e.results} results "
                  f"(needs {cfg.probation_s:g} s or {cfg.probation_frames} results): not committed")
        up.agent.restore(run.swap)
        up.store.revert_current()
        run.verdict = {"bundle": run.bid, "probation": verdict.to_dict()}
        return Outcome(Event.FAILED, reason=reason)
    up.store.commit(run.bid)
    run.verdict = {"bundle": run.bid, "probation": verdict.to_dict(), "verdict": run.proof, "detail": verdict.summary}
    return Outcome(Event.PASSED, reason=verdict.summary)


def committed(up: Updater, run: Run) -> dict[str, Any]:
    removed = up.store.prune(up.cfg.keep)
    return up.status(run.update, run.origin, "committed", **run.verdict, pruned=removed)


def rolled_back(up: Updater, run: Run) -> dict[str, Any]:
    return up.status(run.update, run.origin, "rolled_back", reason=run.reason, **run.verdict)


def rejected(up: Updater, run: Run) -> dict[str, Any]:
    return up.status(run.update, run.origin, "rejected", reason=run.reason)


# one step per state: the non-terminal ones end in an event, the terminal ones in the published verdict
STEPS: dict[State, Step] = {
    State.RECEIVING: receiving, State.VERIFYING: verifying, State.STAGED: staged, State.PROVING: proving,
    State.SWITCHING: switching, State.PROBATION: probation,
}
VERDICTS: dict[State, Callable[["Updater", Run], dict[str, Any]]] = {
    State.COMMITTED: committed, State.ROLLED_BACK: rolled_back, State.REJECTED: rejected,
}
