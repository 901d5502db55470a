"""A drop's `unacknowledged` counts the dropped results that had been handed to the broker and never
acknowledged (the subscriber may hold them), whichever bound drops them and wherever they wait: in memory
(a full disk) or on disk (sent from there, or sent from memory and spilled when the broker went away)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link.outbox import Message, Outbox


def _wire() -> "itertools.count[int]":
    return itertools.count(1)


def _overflow_while_away(box: Outbox, seqs: range) -> None:
    """The broker goes away and these results come: over `max_messages`, the size bound drops the oldest."""
    box.on_disconnected()
    for i in seqs:
        box.put("t", b"%d" % i, 1)
    box.pump(lambda m: None, 10)


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


def test_results_sent_from_disk_and_dropped_by_the_size_bound_count_as_unacknowledged(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", OutboxConfig(memory_messages=10, max_messages=3))
    for i in range(3):
        box.put("t", b"%d" % i, 1)  # the broker is away: on disk
    box.on_connected()
    mids = _wire()
    sent: list[Message] = []
    box.pump(lambda m: (sent.append(m), next(mids))[1], 10)  # all three sent from disk, none acknowledged
    assert len(sent) == 3
    _overflow_while_away(box, range(3, 5))  # 5 > 3: the two oldest go, both sent once
    assert (box.dropped, box.dropped_unacked) == (2, 2)


def test_results_sent_from_memory_then_spilled_and_dropped_from_disk_count_as_unacknowledged(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", OutboxConfig(memory_messages=10, max_messages=3))
    box.on_connected()
    for i in range(3):
        box.put("t", b"%d" % i, 1)
    mids = _wire()
    box.pump(lambda m: next(mids), 10)  # sent from memory, none acknowledged
    _overflow_while_away(box, range(3, 5))  # spilled in order, then the two oldest go
    assert (box.dropped, box.dropped_unacked) == (2, 2)


def test_results_never_sent_or_acknowledged_do_not_count_as_unacknowledged(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", OutboxConfig(memory_messages=10, max_messages=3))
    box.on_connected()
    for i in range(2):
        box.put("t", b"%d" % i, 1)
    mids = _wire()
    box.pump(lambda m: next(mids), 10)
    box.ack(1)  # the first is delivered
    box.pump(lambda m: None, 10)
    _overflow_while_away(box, range(2, 6))  # 5 > 3: #1 (sent, unacknowledged) and #2 (never sent) go
    assert (box.dropped, box.dropped_unacked) == (2, 1)
