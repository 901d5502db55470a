"""The update state machine: its table is the one in docs/updates.md, every state x every event; the state
is durable and a restart resolves an interrupted update by the state it recorded."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from agent.updates.machine import (AFTER_SWITCH, BEFORE_SWITCH, STATE_FILE, TERMINAL, TRANSITIONS, Busy, Event,
                                   Snapshot, State, UpdateMachine, next_state)

DOC = Path(__file__).resolve().parents[2] / "docs" / "updates.md"


def documented_table() -> dict[tuple[str, str], str | None]:
    """The matrix under '## The transition table' in docs/updates.md: a cell is the next state or '·'."""
    text = DOC.read_text()
    rows = [line for line in text[text.index("## The transition table"):].splitlines() if line.startswith("|")]
    events = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    table: dict[tuple[str, str], str | None] = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        state = re.sub(r"\*", "", cells[0])
        for event, cell in zip(events, cells[1:]):
            table[state, event] = None if cell == "·" else cell
    return table


def test_the_documented_table_is_the_table_every_state_by_every_event() -> None:
    doc = documented_table()
    assert len(doc) == len(State) * len(Event), "the documented matrix must cover every state x every event"
    for s in State:
        for e in Event:
            want = doc[s.value, e.value]
            if want is None:
                with pytest.raises(Busy, match=f"update state is {s.value}"):
                    next_state(s, e)
            else:
                assert next_state(s, e).value == want, (s, e)


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_firing_every_event_in_every_state_moves_by_the_table_or_is_busy_and_changes_nothing(
        tmp_path: Path, state: State, event: Event) -> None:
    (tmp_path / STATE_FILE).write_text(json.dumps(Snapshot(state, "u1", "mqtt").to_dict()))
    m = UpdateMachine(tmp_path)
    before = m.snapshot
    if (state, event) in TRANSITIONS:
        snap = m.fire(event, update="u1" if event not in (Event.OFFER, Event.BEGIN, Event.ROLLBACK) else "u2",
                      origin="mqtt", reason="why")
        assert snap.state == TRANSITIONS[state, event]
        assert UpdateMachine(tmp_path).snapshot.state == snap.state  # durable: a new boot reads it back
    else:
        with pytest.raises(Busy):
            m.fire(event, update="u2", origin="url")
        assert m.snapshot == before and UpdateMachine(tmp_path).snapshot == before


def test_every_state_is_reachable_and_every_active_state_can_end() -> None:
    reach, todo = {State.IDLE}, [State.IDLE]
    while todo:
        s = todo.pop()
        for (a, _e), b in TRANSITIONS.items():
            if a == s and b not in reach:
                reach.add(b)
                todo.append(b)
    assert reach == set(State)
    for s in set(State) - TERMINAL:
        assert (s, Event.RECOVER) in TRANSITIONS and TRANSITIONS[s, Event.RECOVER] in TERMINAL


@pytest.mark.parametrize("state", sorted(BEFORE_SWITCH | AFTER_SWITCH, key=lambda s: s.value))
def test_a_restart_resolves_an_interrupted_update_by_its_recorded_state(tmp_path: Path, state: State) -> None:
    (tmp_path / STATE_FILE).write_text(json.dumps(Snapshot(state, "u1", "url", "b-v2").to_dict()))
    verdict = UpdateMachine(tmp_path).resolve_interrupted()
    assert verdict is not None and verdict.update == "u1"
    assert verdict.state == (State.REJECTED if state in BEFORE_SWITCH else State.ROLLED_BACK)
    assert f"interrupted at {state.value}" in (verdict.reason or "")
    assert UpdateMachine(tmp_path).resolve_interrupted() is None  # resolved once, recorded


def test_a_torn_or_foreign_state_file_reads_as_idle(tmp_path: Path) -> None:
    for text in ("", "{", '{"state": "exploded"}', "[1, 2]"):
        (tmp_path / STATE_FILE).write_text(text)
        assert UpdateMachine(tmp_path).snapshot.state == State.IDLE


def test_a_newer_offer_or_a_rollback_cancels_the_delivery_that_was_receiving(tmp_path: Path) -> None:
    m = UpdateMachine(tmp_path)
    m.fire(Event.BEGIN, "download-1", "url")
    cancel = m.cancel
    m.fire(Event.OFFER, "push-2", "mqtt")
    assert cancel.is_set() and not m.cancel.is_set()
    with pytest.raises(Busy, match="superseded"):  # the cancelled download's own events no longer move it
        m.fire(Event.RECEIVED, expect="download-1")
    cancel = m.cancel
    m.fire(Event.ROLLBACK, "rb", "rollback")
    assert cancel.is_set() and m.snapshot.state == State.VERIFYING


def test_two_deliveries_racing_get_one_machine(tmp_path: Path) -> None:
    m = UpdateMachine(tmp_path)
    wins, busy = [], []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        try:
            m.fire(Event.BEGIN, f"d{i}", "inbox")
            wins.append(i)
        except Busy:
            busy.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(busy) == 7 and m.snapshot.update == f"d{wins[0]}"
