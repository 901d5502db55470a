"""A drop's `unacknowledged` counts the dropped results that had been handed to the broker and never
acknowledged (the subscriber may hold them), whichever bound drops them and wherever they wait: in memory
(a full disk) or on disk (sent from there, or sent from memory and spilled when the broker went away)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link.outbox import Outbox


def _wire() -> "itertools.count[int]":
    return itertools.count(1)


def test_a_sent_result_that_ages_out_of_memory_on_a_full_disk_counts_as_unacknowledged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = Outbox(tmp_path / "o.db", OutboxConfig(memory_messages=10, max_age_s=60))
    box.on_connected()
    box.put("t", b"x", 1)
    mids = _wire()
    box.pump(lambda m: next(mids), 10)  # sent, no PUBACK yet
    monkeypatch.setattr(box, "_write", lambda msgs: False)  # the disk is full
    box.on_disconnected()  # back to memory, the spill fails: kept there
    assert [m.sent for m in box.memory] == [True]
    box.memory[0].created -= 120
    box.pump(lambda m: None, 10)  # the age bound drops it
    assert (box.dropped, box.dropped_unacked) == (1, 1)

