"""A durable update.json that is valid JSON but not what the machine wrote (bit rot, a hand edit, a hostile
write) must never stop the agent from booting, nor put non-strict JSON into health."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.updates.machine import STATE_FILE, State, UpdateMachine

GARBAGE = [
    '{"state": "probation", "since": "yesterday"}',
    '{"state": "idle", "since": [1]}',
    '{"state": "idle", "since": 1e999}',
    '{"state": "idle", "since": NaN}',
    '{"state": "proving", "update": {"a": 1}, "origin": 7, "bundle": ["x"], "reason": null, "since": 1}',
    '{"state": ["idle"]}',
]


@pytest.mark.parametrize("text", GARBAGE)
def test_a_garbled_state_file_boots_with_strict_json_and_typed_fields(tmp_path: Path, text: str) -> None:
    (tmp_path / STATE_FILE).write_text(text)
    m = UpdateMachine(tmp_path)  # raised ValueError/TypeError for a non-number "since" before the fix
    snap = m.resolve_interrupted() or m.snapshot
    json.dumps(snap.to_dict(), allow_nan=False)  # health and the state file stay strict JSON
    for key in ("update", "origin", "bundle", "reason"):
        assert snap.to_dict()[key] is None or isinstance(snap.to_dict()[key], str), (key, snap)
    assert snap.state in (State.IDLE, State.REJECTED, State.ROLLED_BACK)


def test_an_interrupted_state_survives_a_garbled_since(tmp_path: Path) -> None:
    """The state is what boot acts on: a bad timestamp must not hide that probation was cut."""
    (tmp_path / STATE_FILE).write_text('{"state": "probation", "update": "u1", "since": "x"}')
    snap = UpdateMachine(tmp_path).resolve_interrupted()
    assert snap is not None and snap.state == State.ROLLED_BACK and snap.update == "u1"
