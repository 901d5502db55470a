"""The broker returns while the disk is still full, with rows spilled while it was away: once those rows
are sent and acknowledged (their DELETE cannot be written), new results must still go out. They waited
in memory behind rows that were already delivered, and beyond the bound were dropped, while connected."""

from __future__ import annotations

import json
from pathlib import Path

from agent.config import OutboxConfig
from agent.link.outbox import Outbox
from tests.link.test_outbox_disk_full import BOUND, Wire, drain
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture


def test_new_results_are_sent_while_delivered_rows_wait_for_their_delete(small_disk: Path) -> None:  # noqa: F811
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND))
    box.on_disconnected()
    for i in range(10):  # the broker is away, the disk has room: spilled
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 10)
    assert box.stats()["on_disk"] == 10
    filler = fill(small_disk)
    box.on_connected()
    wire = Wire()
    for _ in range(5):  # the backlog goes out and is acknowledged; its DELETE may fail on the full disk
        box.pump(wire, 100)
        for mid in range(1, wire.mid + 1):
            box.ack(mid)
    assert wire.sent == list(range(10)), wire.sent
    for i in range(10, 30):  # new results while the disk is still full and the broker is up
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(wire, 100)
        for mid in range(1, wire.mid + 1):
            box.ack(mid)
    s = box.stats()
    assert wire.sent == list(range(30)), f"connected, yet results {sorted(set(range(30)) - set(wire.sent))} were not sent: {s}"
    assert s["dropped"] == 0, s
    filler.unlink()  # space returns: the next acknowledgement also deletes the rows that waited
    box.put("t", json.dumps({"seq": 30}).encode(), 1)
    for _ in range(3):
        box.pump(wire, 100)
        for mid in range(1, wire.mid + 1):
            box.ack(mid)
    assert wire.sent == list(range(31)), wire.sent
    assert box.stats()["depth"] == 0 and box.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0, box.stats()
    box.close()


def test_a_size_drop_the_full_disk_cannot_delete_is_counted_once(small_disk: Path) -> None:  # noqa: F811
    """Rows dropped by outbox.max_messages whose DELETE fails stay in the table: they were selected and
    counted again on every pump, so `dropped` grew without bound while the real backlog stayed."""
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND, max_messages=5))
    box.on_disconnected()
    for i in range(5):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 10)
    assert box.stats()["on_disk"] == 5 and box.stats()["dropped"] == 0
    fill(small_disk)
    for i in range(5, 8):  # over the bound by 3: the 3 oldest go (policy drop_oldest), once
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    for _ in range(10):
        box.pump(Wire(), 10)
    s = box.stats()
    assert box._undeleted, "the DELETE succeeded: this test needs it refused by the full disk"
    assert s["dropped"] == 3 and s["depth"] == 5, s
    for i in range(8, 11):  # 3 more: the next 3 oldest go, not the rows already dropped (still in the table)
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    for _ in range(10):
        box.pump(Wire(), 10)
    s = box.stats()
    assert s["dropped"] == 6 and s["depth"] == 5, s
    wire = drain(box, 5)
    assert wire.sent == [6, 7, 8, 9, 10], wire.sent  # the 6 dropped are not sent; the rest in order


def test_delivered_rows_that_age_out_after_the_disk_frees_are_not_counted_as_dropped(small_disk: Path) -> None:  # noqa: F811
    """Acknowledged rows whose DELETE the full disk refused stay in the table; once space returns, the age
    bound's DELETE removed them and counted them as results lost to age, though the broker had them."""
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND, max_age_s=3600))
    box.on_disconnected()
    for i in range(10):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 10)
    filler = fill(small_disk)
    wire = drain(box, 5)  # delivered and acknowledged; their DELETE refused by the full disk
    box.pump(wire, 100)  # the last acknowledgements are applied: their DELETE is refused again
    assert wire.sent == list(range(10)) and box._undeleted, "this test needs the DELETE refused"
    filler.unlink()
    box.db.execute("UPDATE messages SET created = 0")  # the delivered rows are now older than max_age_s
    box.put("t", json.dumps({"seq": 10}).encode(), 1)
    box.pump(wire, 100)  # no acknowledgement arrives: the age bound deletes them first
    s = box.stats()
    assert s["dropped"] == 0, f"delivered rows counted as lost to age: {s}"
    assert box.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0 and not box._undeleted
    assert wire.sent == list(range(11)) and s["on_disk"] == 0, (wire.sent, s)
    box.close()
