"""The outbox keeps order across spills and reconnects, with real SQLite; the broker side is a plain
publisher function here (the real broker is in test_mqtt.py)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from agent.config import OutboxConfig
from agent.link.outbox import Message, Outbox


class Wire:
    """Hands out message ids and records what was sent; acknowledges only when told."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (mid, seq)
        self.next_mid = 0

    def __call__(self, msg: Message) -> int:
        self.next_mid += 1
        self.sent.append((self.next_mid, json.loads(msg.payload)["seq"]))
        return self.next_mid


def put(box: Outbox, seqs: range) -> None:
    for i in seqs:
        box.put("t", json.dumps({"seq": i}).encode(), 1)


def test_a_spill_while_messages_are_in_flight_keeps_them_ahead_of_the_backlog(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite", OutboxConfig(memory_messages=5))
    box.on_connected()
    wire = Wire()
    put(box, range(0, 3))
    box.pump(wire, max_inflight=3)  # 0, 1, 2 in flight, no PUBACK yet (a slow broker)
    put(box, range(3, 13))
    box.pump(wire, max_inflight=3)  # backlog of 10 > 5 in memory: the newest 5 spill
    assert box.stats()["on_disk"] == 5 and box.spilled == 5
    box.ack(wire.sent[0][0])  # seq 0 acknowledged: it never was on disk
    box.pump(wire, max_inflight=3)
    assert box.stats()["on_disk"] == 5 and box.depth == 12
    box.on_disconnected()  # 1 and 2 never acknowledged: everything goes to disk, below the rows already there
    assert box.stats()["on_disk"] == 12
    box.on_connected()
    resend = Wire()
    for _ in range(10):
        box.pump(resend, max_inflight=100)
    assert [s for _, s in resend.sent] == list(range(1, 13))  # in order, nothing lost, nothing twice
    for mid, _ in resend.sent:
        box.ack(mid)
    box.pump(resend, max_inflight=100)
    assert box.depth == 0


def test_a_slow_broker_spills_only_the_overflow_and_later_results_still_go_out_from_memory_in_order(
        tmp_path: Path) -> None:
    """Issue 48: once one result had spilled, every later one went to disk behind it to keep the order
    (19,367 of a 20,000 burst written to SQLite, where 5,000 fit in memory). Only what memory cannot hold is
    written; the order holds across memory and disk."""
    box = Outbox(tmp_path / "o.sqlite", OutboxConfig(memory_messages=20))
    box.on_connected()
    wire = Wire()
    put(box, range(0, 50))  # a burst: 3 go out, 20 stay in memory, the 27 beyond spill
    box.pump(wire, max_inflight=3)
    assert box.spilled == 27
    n = 50
    for _ in range(40):  # the broker acknowledges 3 a round, 1 new result a round: memory never fills again
        for mid, _ in wire.sent[-3:]:
            box.ack(mid)
        put(box, range(n, n + 1))
        n += 1
        box.pump(wire, max_inflight=3)
    for _ in range(40):
        for mid, _ in wire.sent[-3:]:
            box.ack(mid)
        box.pump(wire, max_inflight=3)
    assert [s for _, s in wire.sent] == list(range(n))
    assert box.depth == 0 and box.stats()["on_disk"] == 0
    # each overflow row inserted once, deleted once; and the clock's frame (two meta rows) with this process's
    # first rows (agent/link/outbox_clock.py)
    assert box.spilled == 27 and box.disk_writes == 2 * 27 + 2


def test_no_disk_writes_while_the_broker_keeps_up(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite", OutboxConfig(memory_messages=5))
    box.on_connected()
    wire = Wire()
    for start in range(0, 100, 10):
        put(box, range(start, start + 10))
        box.pump(wire, max_inflight=50)
        for mid, _ in wire.sent[-10:]:
            box.ack(mid)
        box.pump(wire, max_inflight=50)
    assert [s for _, s in wire.sent] == list(range(100))
    assert box.spilled == 0 and box.stats()["on_disk"] == 0 and box.depth == 0
    # SQLite's own count of rows it changed: an outbox that writes and deletes every message ends with
    # on_disk == 0 too, but not with zero changes.
    assert box.disk_writes == 0


def test_no_disk_writes_check_sees_an_outbox_that_writes_and_deletes_every_message(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite", OutboxConfig(memory_messages=5))
    box.on_connected()
    wire = Wire()
    box.on_disconnected()  # what a wasteful outbox does on every message: write, then delete on PUBACK
    put(box, range(0, 10))
    box.pump(wire, max_inflight=50)
    box.on_connected()
    box.pump(wire, max_inflight=50)
    for mid, _ in wire.sent:
        box.ack(mid)
    box.pump(wire, max_inflight=50)
    assert box.stats()["on_disk"] == 0 and box.depth == 0
    assert box.disk_writes == 22  # 10 inserts and 10 deletes, all counted, and the clock's frame (2 meta rows)


def test_outbox_stats_race_with_the_pump_thread(tmp_path: Path) -> None:
    """stats() from the controller while the link's thread pumps, spills and deletes: one lock, no IndexError."""
    box = Outbox(tmp_path / "o.sqlite", OutboxConfig(memory_messages=5))
    box.on_connected()
    wire = Wire()
    stop = threading.Event()
    errors: list[BaseException] = []

    def pump() -> None:
        try:
            n = 0
            while not stop.is_set():
                put(box, range(n, n + 20))
                n += 20
                box.pump(wire, max_inflight=10)
                for mid, _ in wire.sent[-10:]:
                    box.ack(mid)
                (box.on_disconnected if n % 60 == 0 else box.on_connected)()
                box.pump(wire, max_inflight=10)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    t = threading.Thread(target=pump)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as a loaded device would
    t.start()
    try:
        for _ in range(3000):
            box.stats()
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert not errors, errors


def test_a_message_put_while_the_broker_is_away_is_on_disk_when_put_returns(tmp_path: Path) -> None:
    """A SIGKILL right after put, before any pump: the next boot's outbox holds every message (the pump thread
    used to be the one writing, so under load results already produced were lost with the process)."""
    box = Outbox(tmp_path / "outbox.db", OutboxConfig())
    box.on_disconnected()
    for i in range(25):
        box.put("edge/d/predictions", json.dumps({"seq": i}).encode())
    # no pump, no close: what the file holds now is what a killed process leaves
    again = Outbox(tmp_path / "outbox.db", OutboxConfig())
    assert again.disk_count == 25
    rows = [json.loads(r[0]) for r in again.db.execute("SELECT payload FROM messages ORDER BY id")]
    assert [r["seq"] for r in rows] == list(range(25))
