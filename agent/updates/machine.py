"""The update state machine: named states, a transition table, and the durable current state.

One update at a time is this machine's state, not a lock per thread: a delivery that finds the machine
busy is answered "busy" from the table. The state is written to `store/update.json` on every
transition, so a power cut at any state is resolved at the next boot (see `resolve_interrupted`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from agent.errors import Busy
from agent.fsio import read_json, write_json_atomic
from agent.logsetup import get_logger

log = get_logger("update_machine")

STATE_FILE = "update.json"


class State(str, Enum):
    IDLE = "idle"
    RECEIVING = "receiving"     # chunks arriving, a download streaming, an inbox file picked up
    VERIFYING = "verifying"     # hash, signature, unpack, manifest, version
    STAGED = "staged"           # verified in staging, not proven on this device yet
    PROVING = "proving"         # the self-test child runs under the serving config
    SWITCHING = "switching"     # stored, `current` moves, the engine is swapped in
    PROBATION = "probation"     # the new bundle serves; the controller's tick judges it
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    REJECTED = "rejected"


class Event(str, Enum):
    OFFER = "offer"             # an MQTT offer: the newest offer supersedes a receiving one
    BEGIN = "begin"             # a download or an inbox file starts receiving
    RECEIVED = "received"       # the archive is complete in staging
    ROLLBACK = "rollback"       # the operator's rollback: the previous committed bundle is verified again
    VERIFIED = "verified"
    PROVE = "prove"
    PROVEN = "proven"
    SWITCHED = "switched"
    PASSED = "passed"           # probation held
    FAILED = "failed"           # probation failed, serving could not start, shutdown cut probation short
    REJECT = "reject"           # any refusal or error before the switch (with its reason)
    RECOVER = "recover"         # boot found this state recorded: the update was interrupted


TERMINAL = frozenset({State.IDLE, State.COMMITTED, State.ROLLED_BACK, State.REJECTED})
BEFORE_SWITCH = frozenset({State.RECEIVING, State.VERIFYING, State.STAGED, State.PROVING})
AFTER_SWITCH = frozenset({State.SWITCHING, State.PROBATION})


def _table() -> dict[tuple[State, Event], State]:
    t: dict[tuple[State, Event], State] = {}
    for s in TERMINAL:  # a finished update is as good as none: a new one may start
        t[s, Event.OFFER] = t[s, Event.BEGIN] = State.RECEIVING
        t[s, Event.ROLLBACK] = State.VERIFYING
        t[s, Event.RECOVER] = s
    t[State.RECEIVING, Event.OFFER] = State.RECEIVING   # newest offer wins; the old one is cancelled
    t[State.RECEIVING, Event.ROLLBACK] = State.VERIFYING  # rollback cancels a transfer or download in flight
    t[State.RECEIVING, Event.RECEIVED] = State.VERIFYING
    t[State.VERIFYING, Event.VERIFIED] = State.STAGED
    t[State.STAGED, Event.PROVE] = State.PROVING
    t[State.PROVING, Event.PROVEN] = State.SWITCHING
    t[State.SWITCHING, Event.SWITCHED] = State.PROBATION
    t[State.PROBATION, Event.PASSED] = State.COMMITTED
    for s in BEFORE_SWITCH:
        t[s, Event.REJECT] = State.REJECTED
        t[s, Event.RECOVER] = State.REJECTED   # nothing was switched: staging is cleared at boot
    for s in AFTER_SWITCH:
        t[s, Event.FAILED] = State.ROLLED_BACK
        t[s, Event.RECOVER] = State.ROLLED_BACK  # `current` is put back to `committed` at boot
    return t


TRANSITIONS: dict[tuple[State, Event], State] = _table()


def next_state(state: State, event: Event) -> State:
    """The table, as a function: the next state, or Busy naming the state that refused the event."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise Busy(f"busy: update state is {state.value}; {event.value} is not accepted there") from None


@dataclass(frozen=True)
class Snapshot:
    """The machine's current state as the controller publishes it (health, /metrics, the state file)."""

    state: State = State.IDLE
    update: str | None = None
    origin: str | None = None
    bundle: str | None = None       # the store id once stored
    since: float = 0.0              # wall time of the last transition
    reason: str | None = None       # a terminal state's reason

    @property
    def active(self) -> bool:
        return self.state not in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "update": self.update, "origin": self.origin, "bundle": self.bundle,
                "since": round(self.since, 3), "reason": self.reason}

    @staticmethod
    def from_dict(d: Any) -> "Snapshot":
        if not isinstance(d, dict):
            return Snapshot()
        try:
            state = State(d.get("state", "idle"))
        except ValueError:
            return Snapshot()
        # the file is ours, but a hand edit or bit rot must not stop the boot nor put NaN into health:
        # the state is what boot acts on; a field of the wrong type is dropped
        since = d.get("since")
        t = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else 0.0
        return Snapshot(state, _text(d.get("update")), _text(d.get("origin")), _text(d.get("bundle")),
                        t if math.isfinite(t) else 0.0, _text(d.get("reason")))


def _text(v: Any) -> str | None:
    return v[:200] if isinstance(v, str) else None


class UpdateMachine:
    """The current state, its durable copy, and the only guard on "one update at a time".

    `fire` is atomic: two deliveries racing for the machine get one RECEIVING and one Busy."""

    def __init__(self, store_root: Path):
        self.path = store_root / STATE_FILE
        self._lock = threading.Lock()  # guards only the snapshot swap: never held across work
        self._snap = Snapshot.from_dict(read_json(self.path, expect=dict))
        self.cancel = threading.Event()  # set by OFFER/ROLLBACK superseding a receiving delivery

    @property
    def snapshot(self) -> Snapshot:
        return self._snap

    def fire(self, event: Event, update: str | None = None, origin: str | None = None,
             bundle: str | None = None, reason: str | None = None, expect: str | None = None,
             expect_origin: str | None = None) -> Snapshot:
        """Move by the table; `expect` (an update id) and `expect_origin` (its delivery) make an event from a
        superseded delivery Busy: the same id can arrive by two paths (a URL and an MQTT offer named "v2")."""
        with self._lock:
            cur = self._snap
            theirs = (expect is not None and cur.update != expect) or (
                expect_origin is not None and cur.origin != expect_origin)
            if theirs and event not in (Event.OFFER, Event.BEGIN):
                raise Busy(f"superseded: update {cur.update} ({cur.origin}) holds the machine ({cur.state.value})")
            new_state = next_state(cur.state, event)
            starts = event in (Event.OFFER, Event.BEGIN, Event.ROLLBACK)
            if starts and cur.state == State.RECEIVING:
                self.cancel.set()  # the delivery that was receiving sees it and stops
            if starts:
                self.cancel = threading.Event()
                snap = Snapshot(new_state, update, origin, None, time.time(), None)
            else:
                snap = replace(cur, state=new_state, since=time.time(), bundle=bundle or cur.bundle,
                               reason=reason if new_state in TERMINAL else None)
            self._snap = snap
        self._persist(snap)
        return snap

    def _persist(self, snap: Snapshot) -> None:
        # Best effort: which bundle serves after a power cut is decided by the store's symlinks, not this
        # file; the file only says what was interrupted. A full disk must not turn a verdict into a crash.
        try:
            write_json_atomic(self.path, snap.to_dict())
        except OSError as exc:
            log.error("update.state_not_recorded", state=snap.state.value, file=str(self.path), error=str(exc))

    def resolve_interrupted(self, committed: str | None = None) -> Snapshot | None:
        """At boot: an update recorded in a non-terminal state was cut by a power loss or a kill. Returns
        its verdict (rejected before the switch, rolled back after it), or None when nothing was cut.
        `committed` is the store's committed id: a cut between the store's commit and PASSED is committed."""
        cur = self._snap
        if not cur.active:
            return None
        if cur.state == State.PROBATION and cur.bundle is not None and cur.bundle == committed:
            snap = self.fire(Event.PASSED, reason=f"committed before a restart cut the update (bundle {cur.bundle} "
                                                  "was committed in the store; it serves)")
            log.warning("update.interrupted", update=cur.update, state=cur.state.value, verdict=snap.state.value)
            return snap
        why = (f"interrupted at {cur.state.value} by a restart (power cut, kill or crash); "
               + ("nothing was switched" if cur.state in BEFORE_SWITCH else "the committed bundle serves again"))
        snap = self.fire(Event.RECOVER, reason=why)
        log.warning("update.interrupted", update=cur.update, state=cur.state.value, verdict=snap.state.value)
        return snap
