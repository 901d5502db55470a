"""The words an update's status (`update/status`, health's `update`) is published in.

`state` is always one of the machine's states (agent.updates.machine.State): the fleet operator, the
pusher and /metrics read the same vocabulary the table is written in. `step` is the finer word within
that state (`unpacking` while verifying, `selftest_passed` while proving, `missing` while receiving),
the name the status carried as its `state` before 7 December 2026; `phase` is the machine's state when
it was published, which may belong to another update (a refused offer while one is proving).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from agent.updates.machine import State

# every step a status may name, and the machine state it belongs to
STEP_STATE: dict[str, State] = {
    "receiving": State.RECEIVING,      # an offer taken, an inbox file picked up
    "downloading": State.RECEIVING,    # a URL's body streaming
    "progress": State.RECEIVING,       # every tenth of the chunks
    "missing": State.RECEIVING,        # the chunks a `done` found missing: the pusher resends them
    "verifying": State.VERIFYING,
    "unpacking": State.VERIFYING,
    "verified": State.STAGED,
    "selftest": State.PROVING,
    "selftest_passed": State.PROVING,
    "switched": State.SWITCHING,
    "probation": State.PROBATION,
    "committed": State.COMMITTED,
    "rolled_back": State.ROLLED_BACK,
    "rejected": State.REJECTED,
}

# what `state` may say: the machine's states, `idle` where no update ran yet (health, /metrics)
VOCABULARY: tuple[str, ...] = tuple(s.value for s in State)

# the old `state` words a device in the field may still publish (before 7 December 2026), as their state
LEGACY_STATE: dict[str, str] = {step: st.value for step, st in STEP_STATE.items() if step != st.value}


def status_doc(update: str, origin: str, step: str, phase: State, **detail: Any) -> dict[str, Any]:
    """One status message: `state` from the step's machine state (a KeyError names an unknown step)."""
    return {"update": update, "origin": origin, "state": STEP_STATE[step].value, "step": step,
            "ts": round(time.time(), 3), "phase": phase.value, **detail}


def state_of(doc: Mapping[str, Any]) -> str | None:
    """A status's machine state, also from a device that still publishes the old words (`downloading`)."""
    state = doc.get("state")
    return LEGACY_STATE.get(state, state) if isinstance(state, str) else None
