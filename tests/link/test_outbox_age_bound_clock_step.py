"""Review of issue 43 point 4 ("the outbox age bound survives clock steps"). Within a boot it does
(StepSafeClock: wall time at start + monotonic). Across a restart the stored `created` stamps are compared with
the next boot's wall clock: a boot that started with its clock 8 days behind (an RTC-less device powered off for
8 days: fake-hwclock restores the last save; NTP steps it later, while the broker is away) stamps its backlog 8
days in the past; the restart after NTP drops the whole backlog as older than `outbox.max_age_s` (7 days),
although every row is seconds old. Counted (reason "age"), but the backlog is gone: the issue's "a forward clock
step longer than outbox.max_age_s would drop the whole backlog", across one restart. (The StepSafeClock docstring
named this as the design: "the only measure of the time the agent was down".) Now, within one machine boot, the
next process moves the stamps by the difference of the two processes' clock offsets (agent/link/outbox_clock.py).
Across a reboot the wall clock stays the only measure of the time the device was down."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link import outbox_clock
from agent.link.outbox import Outbox

EIGHT_DAYS = 8 * 86400.0


def test_a_backlog_made_before_ntp_survives_the_restart_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time
    monkeypatch.setattr(outbox_clock.time, "time", lambda: real() - EIGHT_DAYS)  # this boot's clock: before NTP
    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(memory_messages=10))
    box.on_disconnected()  # the broker is away: every result goes to disk
    for i in range(50):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(lambda m: None, 10)
    box.close()
    monkeypatch.setattr(outbox_clock.time, "time", real)  # NTP stepped the clock; the agent restarts
    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(memory_messages=10))
    box.on_connected()
    sent: list[int] = []

    def wire(m) -> int:
        sent.append(json.loads(m.payload)["seq"])
        return len(sent)

    for _ in range(20):
        box.pump(wire, 100)
    dropped = box.stats()["dropped"]
    box.close()
    assert dropped == 0 and len(sent) == 50, f"dropped {dropped}, delivered {len(sent)} of 50"
