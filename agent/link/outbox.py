"""Store and forward: every result enters the outbox; it leaves only when the broker acknowledged it.

Memory while the broker keeps up (no disk writes: flash wear); SQLite in the state directory while
the broker is away, and for the overflow while it is slow, drained in order when it returns, and
surviving an agent restart.
Order is kept by one rule: every message gets its sequence number when it enters, and a row on disk is
stored under that number, so the next message to send is the lowest number in memory or on disk. While
the broker is connected only the overflow beyond `memory_messages` (the newest results) is written; the
older ones in memory and the newer ones that follow still go out from memory, interleaved by number
with the rows read back. Disk writes, deletes and reads are batched: one transaction per pump round.
Bounded by count and age; what the policy drops is counted and reported. The age bound runs on a
monotonic clock within a boot: a wall-clock step (NTP, an RTC set late) drops nothing; across a
restart in one machine boot the stamps follow the step (agent/link/outbox_clock.py).
A full disk (or any failed write) loses nothing silently: a message is kept in memory until a write
succeeds, up to `memory_messages`; beyond that bound the policy drops, counted in `dropped` with an
`outbox.dropped` event (reason "disk"). Writes are retried on every pump, so recovery needs no restart.
What a stop on a full disk cannot keep is counted in a small file allocated while there was space
(`lost_at_stop`, agent/link/lost_at_stop.py), and the next boot adds it to `dropped` in health. What a kill (SIGKILL, the OOM killer, a
stop time-out) leaves in memory is counted in a mapped file (agent/link/held.py), for the next boot likewise.

Threads: `put` and `ack` may be called from any thread (they only append to a deque); the SQLite
connection and the queues are used under one lock, so `stats()` from the controller and `pump()`
from the link's thread never meet half-way.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable

from agent.config import OutboxConfig
from agent.link.held import HeldCounter
from agent.link.lost_at_stop import LostCounter
from agent.link.outbox_clock import StepSafeClock, rebase_stamps, record
from agent.logsetup import get_logger

log = get_logger("outbox")

# What a write to the spill can raise: SQLITE_FULL ("database or disk is full"), I/O errors, ENOSPC.
DISK_ERRORS = (sqlite3.Error, OSError)

# Rows read back from disk at once: one SELECT per batch, not one per pump round or per message.
READ_BATCH = 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# The age bound's lookup; an outbox from before it gains it at the next start, when the disk has room for it.
_INDEX = "CREATE INDEX IF NOT EXISTS messages_created ON messages(created)"


@dataclass
class Message:
    topic: str
    payload: bytes
    qos: int
    created: float
    row: int | None = None  # SQLite id when the message lives on disk (its sequence number)
    sent: bool = False  # handed to the broker at least once: if dropped unacknowledged, it may have arrived
    seq: int = 0  # order of entry, given when the pump takes it in; a row on disk is stored under it


# publish(message) -> mid (int) once handed to the client, or None when it could not be sent now
Publisher = Callable[[Message], "int | None"]


class Outbox:
    def __init__(self, path: Path, cfg: OutboxConfig = OutboxConfig()):
        self.cfg = cfg
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()  # the connection and the queues: pump thread vs stats/close callers
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL survives a process kill (the OS keeps written pages); power loss may lose the last commits.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        try:
            self.db.execute(_INDEX)
        except DISK_ERRORS as exc:  # a full disk at start: the age bound scans the table until a later start
            log.warning("outbox.index_not_created", error=str(exc))
        self._now = StepSafeClock()
        self._clock_recorded = rebase_stamps(self.db, self._now, self._meta)  # else with this process's first rows
        self._incoming: deque[Message] = deque()
        self._wake = threading.Condition()
        self._sleeping = False
        self.memory: deque[Message] = deque()  # not on disk, not sent, in sequence order
        self._loaded: deque[Message] = deque()  # rows read back from disk ahead of sending, in order
        self.inflight: dict[int, Message] = {}  # mid -> message
        self._acks: deque[int] = deque()
        self.connected = False
        self.disk_count = self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        top = self.db.execute("SELECT MAX(id) FROM messages").fetchone()[0] or 0
        used = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
        self._next_seq = max(top, used[0] if used else 0) + 1  # rows of an earlier boot stay ahead
        self._disk_cursor = 0  # highest row read back on this connection
        self._disk_unread = bool(self.disk_count)  # rows above the cursor may wait on disk
        self.dropped = self._meta("dropped")
        self.dropped_unacked = 0  # of those dropped in this process: sent once, never acknowledged
        self._sent_rows: dict[int, float] = {}  # row -> created: on disk, sent once, not acknowledged
        self.spilled = 0
        self.write_failures = 0         # failed spill writes (disk full); each one kept its messages in memory
        self._disk_error: str | None = None  # set while writes fail: logged once when it starts and ends
        self._undeleted: list[int] = []  # rows acknowledged (or sent at QoS 0) whose DELETE failed: retried
        self.sent = 0
        self.acked = 0
        self._unsaved = 0  # drops counted whose total is not on disk yet (also in the held file: a kill keeps it)
        self._held = HeldCounter(path.with_name(path.name + ".held"))
        self._lost = LostCounter(path.with_name(path.name + ".lost"))
        self.lost_at_previous_stop = self._lost.read()
        if self.lost_at_previous_stop:
            log.error("outbox.lost_at_previous_stop", count=self.lost_at_previous_stop,
                      detail="results the last stop could not keep (disk full); counted in dropped")
            # persisted first, then the file is reset (until then the file keeps the count, not the held file)
            if self._count_drops(self.lost_at_previous_stop, "stop", carry=False):
                self._lost.allocate()
        else:
            self._lost.allocate()
        prev = self._held.previous
        if prev is not None and prev.unsaved:  # its drops' total never reached the disk before it ended
            log.error("outbox.unsaved_drops_recovered", count=prev.unsaved, pid=prev.pid,
                      detail="drops the previous process counted but could not write (disk full); counted again")
            self._count_drops(prev.unsaved, "counted by the previous process, not saved")
        self.lost_at_previous_kill, self.unacknowledged_at_previous_kill = self._count_previous_kill()
        if self.disk_count:
            log.info("outbox.recovered", messages=self.disk_count)

    # -- any thread ------------------------------------------------------------------------------------
    def put(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self._held.entered()  # counted before it is held: a kill in between over-counts, never under
        self._incoming.append(Message(topic, payload, qos, self._now()))
        if not self.connected:
            # The broker is away: the message goes to disk before put returns. Left for the pump thread, a
            # SIGKILL under load lost results already produced (the no-loss test, at load 16: result 161).
            with self._lock:
                self._take_incoming()
            return
        self._notify()

    def ack(self, mid: int) -> None:
        """Called from the MQTT network thread on PUBACK (QoS 1)."""
        self._acks.append(mid)
        self._notify()

    def _notify(self) -> None:
        # Only wake a pump that sleeps: a notify per message would cost more than the publish itself.
        if self._sleeping:
            with self._wake:
                self._wake.notify()

    def wait(self, timeout: float) -> None:
        with self._wake:
            self._sleeping = True
            if not self._incoming and not self._acks:
                self._wake.wait(timeout)
            self._sleeping = False

    @property
    def depth(self) -> int:
        with self._lock:
            # a row sent from disk stays in the table until its PUBACK: counted once, as a row on disk
            from_memory = sum(1 for m in self.inflight.values() if m.row is None)
            return len(self._incoming) + len(self.memory) + from_memory + self._pending_on_disk

    @property
    def _pending_on_disk(self) -> int:
        """Rows still to deliver: a row acknowledged (or dropped) whose DELETE waits for disk space is not.
        Order waits only for these; counting the others kept a connected agent mute on a full disk."""
        return max(0, self.disk_count - len(self._undeleted))

    @property
    def disk_writes(self) -> int:
        """Rows SQLite itself changed on this connection (inserts, deletes): wear, as the disk sees it."""
        with self._lock:
            return self.db.total_changes

    # -- pump thread -----------------------------------------------------------------------------------
    def on_connected(self) -> None:
        with self._lock:
            self._on_connected()

    def _on_connected(self) -> None:
        self.connected = True
        self._unload()
        self._disk_cursor = 0
        self._disk_unread = bool(self.disk_count)
        # Unacknowledged messages from memory go back to the front; a new connection sends them again.
        self._requeue_inflight()

    def on_disconnected(self) -> None:
        """The broker is away: nothing stays only in memory from now on."""
        with self._lock:
            self._on_disconnected()

    def _on_disconnected(self) -> None:
        self.connected = False
        self._requeue_inflight()
        self._unload()
        self._spill()

    def pump(self, publish: Publisher, max_inflight: int) -> None:
        """One round: take new messages, apply acks and bounds, send what the window allows."""
        with self._lock:
            self._pump(publish, max_inflight)

    def _pump(self, publish: Publisher, max_inflight: int) -> None:
        self._take_incoming()
        self._apply_acks()
        self._enforce_bounds()
        if not self.connected:
            self._spill()
            return
        self._send(publish, max_inflight)
        if len(self.memory) > self.cfg.memory_messages:  # the broker is slow: the overflow goes to disk
            self._spill_overflow()

    def close(self) -> None:
        """Graceful stop: whatever was not acknowledged is kept on disk for the next start."""
        with self._lock:
            self._take_incoming()
            self._apply_acks()
            self._requeue_inflight()
            self._unload()
            self._spill()
            if self.memory:  # the disk is full at stop: these cannot outlive the process, but their count does
                self._lost.store(len(self.memory))
                # those sent once and never acknowledged may have reached the subscriber: the count is an upper bound
                log.error("outbox.lost_at_stop", count=len(self.memory), error=self._disk_error,
                          unacknowledged=sum(m.sent for m in self.memory),
                          detail="counted in the next boot's outbox.dropped")
            self._held.stopped()  # after lost_at_stop is on disk: a kill between the two counts twice, not never
            self.db.close()

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, float | int]:
        oldest = None
        if self.disk_count:
            row = self.db.execute("SELECT MIN(created) FROM messages").fetchone()
            oldest = row[0]
        for m in (self.memory[0] if self.memory else None, self._incoming[0] if self._incoming else None):
            if m is not None and (oldest is None or m.created < oldest):
                oldest = m.created
        return {
            "depth": self.depth,
            "on_disk": self._pending_on_disk,
            "inflight": len(self.inflight),
            "oldest_age_s": round(max(0.0, self._now() - oldest), 3) if oldest else 0.0,
            "dropped": self.dropped,
            "lost_at_previous_stop": self.lost_at_previous_stop,
            "lost_at_previous_kill": self.lost_at_previous_kill,
            "unacknowledged_at_previous_kill": self.unacknowledged_at_previous_kill,  # of those: may have arrived
            "spilled": self.spilled,
            "memory_only": len(self.memory) if self._disk_error is not None else 0,  # kept while the disk fails
            "write_failures": self.write_failures,
            "sent": self.sent,
            "acked": self.acked,
        }

    # -- internals -------------------------------------------------------------------------------------
    def _take_incoming(self) -> None:
        if not self._incoming:
            return
        while self._incoming:  # into memory first: a message is never out of every queue
            msg = self._incoming.popleft()
            msg.seq = self._next_seq
            self._next_seq += 1
            self.memory.append(msg)
        if not self.connected:
            self._spill()  # durable while the broker is away

    def _apply_acks(self) -> None:
        rows: list[int] = []
        acked = bool(self._acks)
        from_memory = 0
        while self._acks:
            msg = self.inflight.pop(self._acks.popleft(), None)
            if msg is None:
                continue
            self.acked += 1
            if msg.row is not None:
                rows.append(msg.row)
                self._sent_rows.pop(msg.row, None)
            else:
                from_memory += 1
        self._held.left(from_memory, from_memory)
        if rows or (acked and self._undeleted):  # the broker answers: retry the DELETEs the disk refused
            self._delete_rows(rows)

    def _requeue_inflight(self) -> None:
        # dict order is send order, which is sequence order for the messages from memory
        from_memory = [m for m in self.inflight.values() if m.row is None]
        self.inflight.clear()
        self.memory.extendleft(reversed(from_memory))

    def _unload(self) -> None:
        """Forget the rows read back and not yet sent: they are still on disk, read again from the cursor."""
        if self._loaded:
            self._disk_cursor = min(self._disk_cursor, (self._loaded[0].row or 1) - 1)
            self._disk_unread = True
            self._loaded.clear()

    def _spill(self) -> None:
        """All of memory to disk (the broker is away, or the agent stops): each message under its sequence
        number, so the rows sort with what is on disk already."""
        if not self.memory:
            return
        batch = list(self.memory)
        if not self._write(batch):
            self._bound_memory()  # kept in memory, in order, up to the bound
            return
        self.memory.clear()
        self.spilled += len(batch)
        self._held.left(len(batch), sum(m.sent for m in batch))

    def _spill_overflow(self) -> None:
        """Connected, but the broker is slower than the results: only the newest beyond `memory_messages` go
        to disk. The older ones keep going out from memory, and the numbers keep the order."""
        excess = len(self.memory) - self.cfg.memory_messages
        batch = list(islice(self.memory, len(self.memory) - excess, None))
        if not self._write(batch):
            self._bound_memory()
            return
        for _ in range(excess):
            self.memory.pop()
        self.spilled += excess
        self._held.left(excess, sum(m.sent for m in batch))
        if self._loaded and batch[0].seq < (self._loaded[-1].row or 0):
            self._unload()  # rows written below those read back: read again, in order

    def _bound_memory(self) -> None:
        """The spill failed: memory is all there is. Beyond memory_messages the policy drops, counted."""
        excess = len(self.memory) - self.cfg.memory_messages
        if excess <= 0:
            return
        unacked = 0
        for _ in range(excess):
            gone = self.memory.pop() if self.cfg.policy == "drop_newest" else self.memory.popleft()
            unacked += gone.sent
        self._held.left(excess, unacked)
        self._count_drops(excess, "disk", unacked)

    def _write(self, msgs: list[Message]) -> bool:
        """Append to disk under their sequence numbers, all or nothing, in one transaction. False when the
        write failed (disk full): nothing was written, the messages are unchanged and stay where they were."""
        try:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT INTO messages(id, topic, payload, qos, created) VALUES (?, ?, ?, ?, ?)",
                                [(m.seq, m.topic, m.payload, m.qos, m.created) for m in msgs])
            if not self._clock_recorded:  # the frame these stamps are in, for a restart after a clock step
                record(self.db, self._now)
            self.db.execute("COMMIT")
            self._clock_recorded = True
        except DISK_ERRORS as exc:
            self._rollback()
            self.write_failures += 1
            if self._disk_error is None:
                self._disk_error = str(exc)
                log.error("outbox.spill_failed", error=str(exc), kept_in_memory=len(self.memory),
                          bound=self.cfg.memory_messages,
                          detail="results stay in memory up to outbox.memory_messages; beyond, they are dropped "
                                 "and counted; writes are retried")
            return False
        for m in msgs:
            m.row = m.seq
            if m.sent:
                self._sent_rows[m.seq] = m.created  # sent from memory before it was spilled
        self.disk_count += len(msgs)
        self._disk_unread = True
        if self._disk_error is not None:
            log.info("outbox.spill_recovered", failed_writes=self.write_failures)
            self._disk_error = None
        return True

    def _rollback(self) -> None:
        try:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        except DISK_ERRORS:
            pass

    def _read_back(self, room: int) -> None:
        """The next rows above the cursor, in one SELECT of up to READ_BATCH (or the window)."""
        limit = max(READ_BATCH, room)
        rows = self.db.execute(
            "SELECT id, topic, payload, qos, created FROM messages WHERE id > ? ORDER BY id LIMIT ?",
            (self._disk_cursor, limit),
        ).fetchall()
        self._disk_unread = len(rows) == limit
        done = set(self._undeleted)  # acknowledged already; their DELETE waits for disk space
        for row, topic, payload, qos, created in rows:
            if row not in done:
                self._loaded.append(Message(topic, bytes(payload), qos, created, row, seq=row))
        if rows:
            self._disk_cursor = rows[-1][0]
        if not rows and not self.inflight and self.disk_count:
            self.disk_count = self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]

    def _send(self, publish: Publisher, max_inflight: int) -> None:
        """The lowest sequence number first, from memory or from the rows read back, while the window allows."""
        sent_qos0: list[int] = []
        first_from_memory = 0
        try:
            while len(self.inflight) < max_inflight:
                if not self._loaded and self._disk_unread and self._pending_on_disk:
                    self._read_back(max_inflight - len(self.inflight))
                disk = self._loaded[0] if self._loaded else None
                mem = self.memory[0] if self.memory else None
                if disk is None and mem is None:
                    return
                from_disk = mem is None or (disk is not None and disk.seq < mem.seq)
                msg = disk if from_disk else mem
                assert msg is not None
                mid = publish(msg)
                if mid is None:
                    return
                (self._loaded if from_disk else self.memory).popleft()
                first_from_memory += not (from_disk or msg.sent)
                msg.sent = True
                self.sent += 1
                if from_disk and msg.qos == 0:
                    sent_qos0.append(msg.seq)
                    continue
                self.inflight[mid] = msg
                if from_disk:
                    self._sent_rows[msg.seq] = msg.created
        finally:
            self._held.sent(first_from_memory)
            if sent_qos0:
                self._delete_rows(sent_qos0)

    def _delete_rows(self, rows: list[int]) -> None:
        # a DELETE writes too (the WAL): on a full disk the rows wait here and are skipped when sending
        rows = list(dict.fromkeys(self._undeleted + rows))  # a row dropped by the bounds may wait here already
        try:
            self.db.execute("BEGIN")  # one transaction for the batch: a commit per row bounded the drain
            cur = self.db.executemany("DELETE FROM messages WHERE id = ?", [(r,) for r in rows])
            self.db.execute("COMMIT")
        except DISK_ERRORS:
            self._rollback()
            self._undeleted = rows
            return
        self._undeleted = []
        self.disk_count -= cur.rowcount if cur.rowcount >= 0 else len(rows)

    def _enforce_bounds(self) -> None:
        try:
            self._enforce_bounds_now()
        except DISK_ERRORS as exc:  # a DELETE on a full disk: the bounds are applied at a later pump
            self._rollback()
            log.debug("outbox.bounds_deferred", error=str(exc))

    def _enforce_bounds_now(self) -> None:
        cfg = self.cfg
        excess = self.depth - cfg.max_messages
        if excess > 0:
            self._drop(excess, "size")
        cutoff = self._now() - cfg.max_age_s
        if self.disk_count:
            # the index on created: no rows this old costs one lookup, not a scan of the backlog per pump
            ids = [r[0] for r in self.db.execute("SELECT id FROM messages WHERE created < ?", (cutoff,))]
            if ids:
                # one thread owns the table (the pump's lock): the DELETE removes exactly these rows
                self.db.execute("DELETE FROM messages WHERE created < ?", (cutoff,))
                self.disk_count -= len(ids)
                # rows delivered (or dropped) whose DELETE the full disk refused go now, but were never
                # lost to age: only the others are counted
                waited, aged_ids = set(self._undeleted), set(ids)
                self._undeleted = [r for r in self._undeleted if r not in aged_ids]
                aged = [r for r in ids if r not in waited]
                self._count_drops(len(aged), "age", self._forget_sent(aged))
        while self.memory and self.memory[0].created < cutoff:
            msg = self.memory.popleft()
            self._held.left(1, msg.sent)
            self._count_drops(1, "age", msg.sent)

    def _forget_sent(self, rows: list[int]) -> int:
        """Rows dropped from the table: how many had been sent and never acknowledged. Those in flight leave
        it: their PUBACK must not DELETE them again (on a full disk the refused DELETE would put rows no
        longer in the table into _undeleted, hiding as many real ones). Those read back and not yet sent
        are not sent."""
        gone = set(rows)
        for mid in [mid for mid, m in self.inflight.items() if m.row in gone]:
            del self.inflight[mid]
        if self._loaded:
            self._loaded = deque(m for m in self._loaded if m.row not in gone)
        return sum(self._sent_rows.pop(r, None) is not None for r in rows)

    def _drop(self, n: int, why: str) -> None:
        """The size bound: the n oldest (or newest) by sequence number, wherever they wait."""
        newest = self.cfg.policy == "drop_newest"
        disk_ids: list[int] = []
        if self._pending_on_disk:
            order = "DESC" if newest else "ASC"
            # rows already dropped (or delivered) whose DELETE the full disk refused are still in the table:
            # skipped, or the same rows would be counted again on every pump while the backlog stayed
            gone = set(self._undeleted)
            disk_ids = [r[0] for r in self.db.execute(f"SELECT id FROM messages ORDER BY id {order} LIMIT ?",
                                                      (n + len(gone),)) if r[0] not in gone][:n]
        end = reversed(self.memory) if newest else iter(self.memory)
        candidates = [(i, True) for i in disk_ids] + [(m.seq, False) for m in islice(end, n)]
        chosen = sorted(candidates, reverse=newest)[:n]
        ids = [i for i, on_disk in chosen if on_disk]
        unacked = 0
        if ids:
            self._delete_rows(ids)
            unacked = self._forget_sent(ids)
        from_memory = 0
        for _ in range(len(chosen) - len(ids)):
            msg = self.memory.pop() if newest else self.memory.popleft()
            unacked += msg.sent
            from_memory += msg.sent
        self._held.left(len(chosen) - len(ids), from_memory)
        self._count_drops(len(chosen), why, unacked)

    def _count_drops(self, n: int, why: str, unacked: int = 0, carry: bool = True) -> bool:
        """`unacked`: of the `n`, those sent once and never acknowledged (the broker went away first): the
        subscriber may have them, so a count of drops is an upper bound on what was lost by that many.
        True when the total is on disk. `carry`: a count the disk cannot take is kept in the held file until
        it can (False: the caller's own file keeps it)."""
        if n <= 0:
            return True
        self.dropped += n
        self.dropped_unacked += unacked
        log.warning("outbox.dropped", count=n, reason=why, policy=self.cfg.policy, total=self.dropped,
                    unacknowledged=unacked, unacknowledged_total=self.dropped_unacked)
        try:
            self.db.execute("INSERT INTO meta(key, value) VALUES('dropped', ?) "
                            "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (self.dropped,))
        except DISK_ERRORS:
            # counted in memory (health shows it), persisted with the next drop that can be written; meanwhile
            # in the held file, so a kill before then does not lose the count (the next boot adds it)
            if carry:
                self._unsaved += n
                self._held.unsaved(self._unsaved)
            return False
        self._unsaved = 0
        self._held.unsaved(0)
        return True

    def _count_previous_kill(self) -> tuple[int, int]:
        """The previous process ended without a clean stop (SIGKILL, the OOM killer, a stop time-out): what
        it held only in memory is gone; counted in `dropped` like a loss at stop. Returns the count and, of
        it, those sent once and never acknowledged."""
        prev = self._held.previous
        if prev is None or prev.clean or not prev.held:
            return 0, 0
        log.error("outbox.lost_at_previous_kill", count=prev.held, unacknowledged=prev.unacknowledged, pid=prev.pid,
                  detail="the previous process was killed (SIGKILL, the OOM killer, a stop time-out) while these "
                         "results were held only in memory; counted in dropped (those sent once and never "
                         "acknowledged may have reached the broker)")
        self._count_drops(prev.held, "killed", prev.unacknowledged)
        return prev.held, prev.unacknowledged

    def _meta(self, key: str) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0
