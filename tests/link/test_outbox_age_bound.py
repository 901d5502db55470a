"""The age bound's bookkeeping in Outbox._enforce_bounds_now (agent/link/outbox.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link import outbox as outbox_mod
from agent.link import outbox_clock
from agent.link.outbox import Outbox


def test_the_age_bound_builds_the_aged_set_once_not_once_per_waiting_row(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`[r for r in self._undeleted if r not in set(ids)]` builds set(ids) again for every waiting row:
    thousands of acknowledged rows waiting for their DELETE times a backlog of aged rows is minutes of the
    pump thread, the outbox lock held, once the disk frees."""
    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(memory_messages=10, max_age_s=3600))
    box.on_disconnected()
    for i in range(200):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(lambda m: None, 10)
    rows = [r[0] for r in box.db.execute("SELECT id FROM messages ORDER BY id")]
    box._undeleted = rows[:100]  # delivered; their DELETE refused by a full disk earlier
    box.db.execute("UPDATE messages SET created = 0")
    builds = []
    real_set = set

    def counting_set(*a):
        builds.append(len(a[0]) if a else 0)
        return real_set(*a)

    monkeypatch.setattr(outbox_mod, "set", counting_set, raising=False)
    box.pump(lambda m: None, 10)
    big = [n for n in builds if n == len(rows)]
    assert len(big) <= 1, f"set(ids) of {len(rows)} aged rows built {len(big)} times"
    assert box.stats()["dropped"] == 100 and not box._undeleted
    assert box.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    box.close()


class _RefusingDeletes:
    """The connection, but its per-row DELETEs (`executemany`) fail as on a full disk while `refuse`."""

    def __init__(self, db) -> None:
        self._db, self.refuse = db, False

    def executemany(self, sql, rows):
        if self.refuse:
            raise outbox_mod.sqlite3.OperationalError("database or disk is full")
        return self._db.executemany(sql, rows)

    def __getattr__(self, name):
        return getattr(self._db, name)


def _three_rows_in_flight(tmp_path: Path, cfg: OutboxConfig):
    """An outbox whose DELETEs can be refused (`box.db.refuse`), with seq 0-2 spilled while the broker was
    away and now sent from disk, in flight (the window of 3 full); (box, what was sent, the publisher)."""
    box = Outbox(tmp_path / "outbox.sqlite", cfg)
    box.db = _RefusingDeletes(box.db)  # type: ignore[assignment]
    sent: list[int] = []

    def wire(m) -> int:
        sent.append(json.loads(m.payload)["seq"])
        return len(sent)

    box.on_disconnected()
    for i in range(3):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.on_connected()
    box.pump(wire, 3)
    assert sent == [0, 1, 2]
    return box, sent, wire


def test_rows_in_flight_that_age_out_do_not_hide_a_waiting_row_when_their_ack_cannot_delete(tmp_path: Path) -> None:
    """Rows sent from disk and in flight are deleted by the age bound but stay in `inflight`; their PUBACK
    then DELETEs them again, and on a full disk that DELETE puts rows no longer in the table into
    `_undeleted`: `_pending_on_disk` (disk_count - len(_undeleted)) hides real rows still to send, and the
    next results go out from memory ahead of them."""
    box, sent, wire = _three_rows_in_flight(tmp_path, OutboxConfig(memory_messages=10, max_age_s=3600))
    box.db.execute("UPDATE messages SET created = 0")  # they age out before their PUBACK
    box.put("t", json.dumps({"seq": 3}).encode(), 1)
    box.pump(wire, 3)  # seq 3 goes to disk behind them; the age bound deletes seq 0-2
    assert box.stats()["dropped"] == 3
    box.db.refuse = True  # the disk fills
    for mid in (1, 2, 3):
        box.ack(mid)
    box.put("t", json.dumps({"seq": 4}).encode(), 1)
    box.pump(wire, 3)
    box.pump(wire, 3)
    s = box.stats()
    assert s["on_disk"] >= 1 or 3 in sent, f"seq 3 waits on disk but is counted nowhere: {s}, sent {sent}"
    assert sent[:4] == [0, 1, 2, 3], f"a new result went out ahead of one waiting on disk: {sent}"
    box.db.refuse = False
    box.close()


def test_rows_in_flight_dropped_by_the_size_bound_do_not_hide_a_waiting_row_when_their_ack_cannot_delete(
        tmp_path: Path) -> None:
    """The same for outbox.max_messages: the oldest rows dropped while in flight stayed in `inflight`."""
    box, sent, wire = _three_rows_in_flight(tmp_path, OutboxConfig(memory_messages=10, max_messages=3))
    for i in (3, 4, 5):  # over the bound by 3: the oldest (in flight) go, policy drop_oldest
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(wire, 3)
    assert box.stats()["dropped"] == 3, box.stats()
    box.db.refuse = True  # the disk fills
    for mid in (1, 2, 3):
        box.ack(mid)
    box.pump(wire, 3)
    box.pump(wire, 3)
    s = box.stats()
    assert sent[:6] == [0, 1, 2, 3, 4, 5], f"results waiting on disk were hidden: {s}, sent {sent}"
    box.db.refuse = False
    box.close()


def test_a_forward_wall_clock_step_longer_than_max_age_drops_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: the age bound read the wall clock, so an NTP step (or an RTC set late) forward by more than
    outbox.max_age_s dropped the whole backlog, on disk and in memory. Within a boot it runs on a monotonic
    clock."""
    box = Outbox(tmp_path / "outbox.sqlite", OutboxConfig(memory_messages=10, max_age_s=60))
    box.on_disconnected()
    for i in range(5):  # the broker away: on disk
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.on_connected()
    for i in range(5, 10):  # back, but nothing acknowledged yet: in memory
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(lambda m: None, 10)
    assert box.stats()["depth"] == 10
    stepped = outbox_clock.time.time() + 3600
    monkeypatch.setattr(outbox_clock.time, "time", lambda: stepped)
    box.pump(lambda m: None, 10)
    s = box.stats()
    assert s["dropped"] == 0 and s["depth"] == 10, s
    box.close()
