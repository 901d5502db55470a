"""Store and forward: every result enters the outbox; it leaves only when the broker acknowledged it.

Memory while the broker keeps up (no disk writes: flash wear); SQLite in the state directory while
the broker is away or slow, drained in order when it returns, and surviving an agent restart.
Order is kept by one rule: while anything is on disk, new messages go to disk behind it.
Bounded by count and age; what the policy drops is counted and reported.
A full disk (or any failed write) loses nothing silently: a message is kept in memory until a write
succeeds, up to `memory_messages`; beyond that bound the policy drops, counted in `dropped` with an
`outbox.dropped` event (reason "disk"). Writes are retried on every pump, so recovery needs no restart.

Threads: `put` and `ack` may be called from any thread (they only append to a deque); the SQLite
connection and the queues are used under one lock, so `stats()` from the controller and `pump()`
from the link's thread never meet half-way.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.config import OutboxConfig
from agent.logsetup import get_logger

log = get_logger("outbox")

# What a write to the spill can raise: SQLITE_FULL ("database or disk is full"), I/O errors, ENOSPC.
DISK_ERRORS = (sqlite3.Error, OSError)

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


@dataclass
class Message:
    topic: str
    payload: bytes
    qos: int
    created: float
    row: int | None = None  # SQLite id when the message lives on disk
    sent: bool = False  # handed to the broker at least once: if dropped unacknowledged, it may have arrived


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
        self._incoming: deque[Message] = deque()
        self._wake = threading.Condition()
        self._sleeping = False
        self.memory: deque[Message] = deque()
        self.inflight: dict[int, Message] = {}  # mid -> message
        self._acks: deque[int] = deque()
        self.connected = False
        self.disk_count = self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        self._disk_cursor = 0  # highest row sent on this connection
        self.dropped = self._meta("dropped")
        self.dropped_unacked = 0  # of those dropped in this process: sent once, never acknowledged
        self._sent_rows: dict[int, float] = {}  # row -> created: on disk, sent once, not acknowledged
        self.spilled = 0
        self.write_failures = 0         # failed spill writes (disk full); each one kept its messages in memory
        self._disk_error: str | None = None  # set while writes fail: logged once when it starts and ends
        self._undeleted: list[int] = []  # rows acknowledged (or sent at QoS 0) whose DELETE failed: retried
        self.sent = 0
        self.acked = 0
        if self.disk_count:
            log.info("outbox.recovered", messages=self.disk_count)

    # -- any thread ------------------------------------------------------------------------------------
    def put(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self._incoming.append(Message(topic, payload, qos, time.time()))
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
        self._disk_cursor = 0
        # Unacknowledged messages from memory go back to the front; a new connection sends them again.
        self._requeue_inflight()

    def on_disconnected(self) -> None:
        """The broker is away: nothing stays only in memory from now on."""
        with self._lock:
            self._on_disconnected()

    def _on_disconnected(self) -> None:
        self.connected = False
        self._requeue_inflight()
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
        if self._pending_on_disk:
            self._send_from_disk(publish, max_inflight)
        else:
            while self.memory and len(self.inflight) < max_inflight:
                msg = self.memory[0]
                mid = publish(msg)
                if mid is None:
                    return
                self.memory.popleft()
                self.inflight[mid] = msg
                msg.sent = True
                self.sent += 1
            if len(self.memory) > self.cfg.memory_messages:  # the broker is slow: spill the backlog
                self._spill()

    def close(self) -> None:
        """Graceful stop: whatever was not acknowledged is kept on disk for the next start."""
        with self._lock:
            self._take_incoming()
            self._apply_acks()
            self._requeue_inflight()
            self._spill()
            if self.memory:  # the disk is full at stop: these cannot outlive the process
                log.error("outbox.lost_at_stop", count=len(self.memory), error=self._disk_error)
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
            "oldest_age_s": round(time.time() - oldest, 3) if oldest else 0.0,
            "dropped": self.dropped,
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
            self.memory.append(self._incoming.popleft())
        if self._pending_on_disk or not self.connected:
            self._spill()  # behind what is already on disk, or durable while the broker is away

    def _apply_acks(self) -> None:
        rows: list[int] = []
        acked = bool(self._acks)
        while self._acks:
            msg = self.inflight.pop(self._acks.popleft(), None)
            if msg is None:
                continue
            self.acked += 1
            if msg.row is not None:
                rows.append(msg.row)
                self._sent_rows.pop(msg.row, None)
        if rows or (acked and self._undeleted):  # the broker answers: retry the DELETEs the disk refused
            self._delete_rows(rows)

    def _requeue_inflight(self) -> None:
        # dict order is send order, which is the order the messages were put
        from_memory = [m for m in self.inflight.values() if m.row is None]
        self.inflight.clear()
        self.memory.extendleft(reversed(from_memory))

    def _spill(self) -> None:
        """Memory to disk, keeping order: messages already sent from memory and still awaiting their
        PUBACK are older than the backlog, so they are written first and stay in flight under their row."""
        sent = [m for m in self.inflight.values() if m.row is None]
        if sent:
            if not self._write(sent):
                self._bound_memory()
                return
            self._disk_cursor = max(self._disk_cursor, sent[-1].row or 0)  # in flight: not sent again now
        if not self.memory:
            return
        batch = list(self.memory)
        if not self._write(batch):
            self._bound_memory()  # kept in memory, in order, up to the bound
            return
        self.memory.clear()
        self.spilled += len(batch)

    def _bound_memory(self) -> None:
        """The spill failed: memory is all there is. Beyond memory_messages the policy drops, counted."""
        excess = len(self.memory) - self.cfg.memory_messages
        if excess <= 0:
            return
        unacked = 0
        for _ in range(excess):
            gone = self.memory.pop() if self.cfg.policy == "drop_newest" else self.memory.popleft()
            unacked += gone.sent
        self._count_drops(excess, "disk", unacked)

    def _write(self, msgs: list[Message]) -> bool:
        """Append to disk in order, all or nothing; each message learns its row id. False when the write
        failed (disk full): nothing was written, the messages are unchanged and stay where they were."""
        rows: list[int] = []
        try:
            self.db.execute("BEGIN")
            for m in msgs:
                rows.append(self.db.execute("INSERT INTO messages(topic, payload, qos, created) VALUES (?, ?, ?, ?)",
                                            (m.topic, m.payload, m.qos, m.created)).lastrowid or 0)
            self.db.execute("COMMIT")
        except DISK_ERRORS as exc:
            try:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
            except DISK_ERRORS:
                pass
            self.write_failures += 1
            if self._disk_error is None:
                self._disk_error = str(exc)
                log.error("outbox.spill_failed", error=str(exc), kept_in_memory=len(self.memory),
                          bound=self.cfg.memory_messages,
                          detail="results stay in memory up to outbox.memory_messages; beyond, they are dropped "
                                 "and counted; writes are retried")
            return False
        for m, row in zip(msgs, rows):
            m.row = row
            if m.sent:
                self._sent_rows[row] = m.created  # sent from memory before it was spilled
        self.disk_count += len(msgs)
        if self._disk_error is not None:
            log.info("outbox.spill_recovered", failed_writes=self.write_failures)
            self._disk_error = None
        return True

    def _send_from_disk(self, publish: Publisher, max_inflight: int) -> None:
        room = max_inflight - len(self.inflight)
        if room <= 0:
            return
        rows = self.db.execute(
            "SELECT id, topic, payload, qos, created FROM messages WHERE id > ? ORDER BY id LIMIT ?",
            (self._disk_cursor, room),
        ).fetchall()
        done = set(self._undeleted)
        for row, topic, payload, qos, created in rows:
            if row in done:  # acknowledged already; its DELETE waits for disk space
                self._disk_cursor = row
                continue
            msg = Message(topic, bytes(payload), qos, created, row)
            mid = publish(msg)
            if mid is None:
                return
            msg.sent = True
            self._disk_cursor = row
            self.sent += 1
            if qos == 0:
                self._delete_rows([row])
            else:
                self.inflight[mid] = msg
                self._sent_rows[row] = created
        if not rows and not self.inflight and self.disk_count:
            self.disk_count = self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]

    def _delete_rows(self, rows: list[int]) -> None:
        # a DELETE writes too (the WAL): on a full disk the rows wait here and are skipped when sending
        rows = list(dict.fromkeys(self._undeleted + rows))  # a row dropped by the bounds may wait here already
        try:
            cur = self.db.executemany("DELETE FROM messages WHERE id = ?", [(r,) for r in rows])
        except DISK_ERRORS:
            self._undeleted = rows
            return
        self._undeleted = []
        self.disk_count -= cur.rowcount if cur.rowcount >= 0 else len(rows)

    def _enforce_bounds(self) -> None:
        try:
            self._enforce_bounds_now()
        except DISK_ERRORS as exc:  # a DELETE on a full disk: the bounds are applied at a later pump
            log.debug("outbox.bounds_deferred", error=str(exc))

    def _enforce_bounds_now(self) -> None:
        cfg = self.cfg
        excess = self.depth - cfg.max_messages
        if excess > 0:
            self._drop(excess, "size")
        if self.disk_count:
            cutoff = time.time() - cfg.max_age_s
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
        while self.memory and self.memory[0].created < time.time() - cfg.max_age_s:
            msg = self.memory.popleft()
            self._count_drops(1, "age", msg.sent)

    def _forget_sent(self, rows: list[int]) -> int:
        """Rows dropped from the table: how many had been sent and never acknowledged. Those in flight leave
        it: their PUBACK must not DELETE them again (on a full disk the refused DELETE would put rows no
        longer in the table into _undeleted, hiding as many real ones)."""
        gone = set(rows)
        for mid in [mid for mid, m in self.inflight.items() if m.row in gone]:
            del self.inflight[mid]
        return sum(self._sent_rows.pop(r, None) is not None for r in rows)

    def _drop(self, n: int, why: str) -> None:
        newest = self.cfg.policy == "drop_newest"
        dropped = unacked = 0
        if self._pending_on_disk:
            order = "DESC" if newest else "ASC"
            # rows already dropped (or delivered) whose DELETE the full disk refused are still in the table:
            # skipped, or the same rows would be counted again on every pump while the backlog stayed
            gone = set(self._undeleted)
            ids = [r[0] for r in self.db.execute(f"SELECT id FROM messages ORDER BY id {order} LIMIT ?",
                                                 (n + len(gone),)) if r[0] not in gone][:n]
            self._delete_rows(ids)
            dropped += len(ids)
            unacked = self._forget_sent(ids)
        while dropped < n and self.memory:
            msg = self.memory.pop() if newest else self.memory.popleft()
            unacked += msg.sent
            dropped += 1
        self._count_drops(dropped, why, unacked)

    def _count_drops(self, n: int, why: str, unacked: int = 0) -> None:
        """`unacked`: of the `n`, those sent once and never acknowledged (the broker went away first): the
        subscriber may have them, so a count of drops is an upper bound on what was lost by that many."""
        if n <= 0:
            return
        self.dropped += n
        self.dropped_unacked += unacked
        log.warning("outbox.dropped", count=n, reason=why, policy=self.cfg.policy, total=self.dropped,
                    unacknowledged=unacked, unacknowledged_total=self.dropped_unacked)
        try:
            self.db.execute("INSERT INTO meta(key, value) VALUES('dropped', ?) "
                            "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (self.dropped,))
        except DISK_ERRORS:
            pass  # counted in memory (health shows it); persisted with the next drop that can be written

    def _meta(self, key: str) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0
