"""The broker returns while the disk is still full, with rows spilled while it was away: once those rows
are sent and acknowledged (their DELETE cannot be written), new results must still go out. They waited
in memory behind rows that were already delivered, and beyond the bound were dropped, while connected."""

from __future__ import annotations

import json
from pathlib import Path

from agent.config import OutboxConfig
from agent.link.outbox import Outbox
from test_outbox_disk_full import BOUND, Wire, fill, small_disk  # noqa: F401 - small_disk is a fixture


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
