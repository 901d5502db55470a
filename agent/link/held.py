"""What the outbox holds only in memory, counted where a kill cannot erase it (issue 43, "count every loss").

The outbox keeps up to `outbox.memory_messages` results in memory while the broker keeps up (no disk writes:
flash wear, speed). A clean stop spills them or counts what it cannot keep (`lost_at_stop`); a SIGKILL, the
OOM killer or a stop time-out ends the process with no word, and those results vanished uncounted (the chaos
script: 10 over 30 kills). So the outbox keeps a few counters in a small file of the state directory mapped
into memory: a store into the mapping is a store into the kernel's page cache, which outlives the process
(SIGKILL, OOM) though not a power cut (the kernel writes the page back within seconds, not at each store).
The hot path pays one 8-byte store per result through a memoryview (about 0.1 us here), not a system call; the
pump stores its counts once per batch.

Layout (eight native-endian u64, 64 bytes: the file never leaves its device): magic, pid, state (0 running, 1 stopped cleanly),
entered (results that entered memory), left (results that left memory: acknowledged, spilled to disk, or
dropped and counted), sent (of those that entered, sent once), sent_left (of those that left, sent once),
unsaved (drops counted whose total could not be written to disk yet: the next boot adds them, however this ended).
Held only in memory = entered - left; of them sent once and never acknowledged (the broker may have them, so
the count is an upper bound by that many) = sent - sent_left.

The next boot reads the previous process's counters: state still "running" means it did not stop cleanly, and
what it held only in memory is counted in `dropped`. Then the counters are reset for this process. `entered`
is written by `put`'s thread(s) and the others under the outbox lock, so no counter has two writers.
The file is written with real bytes at creation (never a sparse hole: a store into a hole on a full disk
raises SIGBUS) and reused in place afterwards, so a boot on a full disk keeps counting; when it cannot be
created at all (the disk full at the very first boot) nothing is counted, and the outbox works without it.
"""

from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from agent.logsetup import get_logger

log = get_logger("outbox")

MAGIC = b"EAHELD01"
SIZE = 64
# slots (u64 indexes): 0 the magic
_PID, _STATE, _ENTERED, _LEFT, _SENT, _SENT_LEFT, _UNSAVED = 1, 2, 3, 4, 5, 6, 7
RUNNING, STOPPED = 0, 1


@dataclass(frozen=True)
class Previous:
    """What the previous process left in the file."""

    pid: int
    clean: bool  # it stopped cleanly (what it could not keep is in `lost_at_stop`)
    held: int  # results held only in memory when it ended
    unacknowledged: int  # of those, sent once and never acknowledged
    unsaved: int = 0  # drops it counted whose total it could not write to disk (a full disk), however it ended


class HeldCounter:
    """The counters of this process, in a mapped file; `previous` is what the last process left."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.previous: Previous | None = None
        self._map: mmap.mmap | None = None
        self._slots: memoryview | None = None  # the map as u64 slots: a store is one item assignment
        self._entered = itertools.count(1)  # next() is atomic under the GIL: put may run on several threads
        self._left = self._sent = self._sent_left = 0
        try:
            self._open()
        except (OSError, ValueError) as exc:
            log.error("outbox.held_counter_unavailable", file=str(path), error=str(exc),
                      detail="results held only in memory are not counted if this process is killed")
            self._map, self._slots = None, None

    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            raw = os.pread(fd, SIZE, 0)
            if len(raw) == SIZE and raw[:8] == MAGIC:
                self.previous = _parse(raw)
            elif raw:
                log.error("outbox.held_counter_unreadable", file=str(self.path), error=f"bad contents {raw[:16]!r}")
            if os.fstat(fd).st_size != SIZE or raw[:8] != MAGIC:
                # real bytes, not a hole: this needs space once, at the first boot (and on a bad file)
                os.ftruncate(fd, 0)
                os.pwrite(fd, MAGIC + bytes(SIZE - 8), 0)
                os.fsync(fd)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        m = self._map
        m[8:SIZE] = bytes(SIZE - 8)  # reset for this process: state RUNNING, every counter 0
        self._slots = memoryview(m).cast("Q")
        self._slots[_PID] = os.getpid()
        m.flush()  # a power cut later must not bring back the previous process's counts

    # -- hot path: one 8-byte store into the page cache each ----------------------------------------------
    def entered(self) -> None:
        slots = self._slots
        if slots is not None:
            try:
                slots[_ENTERED] = next(self._entered)
            except ValueError:  # released by a stop on another thread: a result put after close is not held
                pass

    # -- under the outbox lock ------------------------------------------------------------------------------
    def left(self, n: int, sent: int) -> None:
        """`n` results left memory (acknowledged, on disk, or dropped and counted), `sent` of them sent once."""
        if self._slots is not None and n:
            self._left += n
            self._slots[_LEFT] = self._left
            if sent:
                self._sent_left += sent
                self._slots[_SENT_LEFT] = self._sent_left

    def sent(self, n: int) -> None:
        """`n` results from memory sent for the first time."""
        if self._slots is not None and n:
            self._sent += n
            self._slots[_SENT] = self._sent

    def unsaved(self, n: int) -> None:
        """Drops counted in memory whose total is not on disk yet (the outbox's meta write failed): kept here so
        a kill before the next write does not lose their count (the next boot adds them to `dropped`)."""
        if self._slots is not None:
            self._slots[_UNSAVED] = max(0, n)

    def stopped(self) -> None:
        """A clean stop: what memory still holds is counted by `lost_at_stop`, not again by the next boot."""
        if self._slots is not None and self._map is not None:
            slots, self._slots = self._slots, None
            slots[_STATE] = STOPPED
            slots.release()  # before close: a map with a view on it cannot be closed
            try:
                self._map.flush()
            except OSError:  # the state reached the page cache; only a power cut now could lose it
                pass
            self._map.close()
            self._map = None


def _parse(raw: bytes) -> Previous:
    slots = memoryview(raw).cast("Q")
    pid, state, entered, left, sent, sent_left, unsaved = (
        slots[i] for i in (_PID, _STATE, _ENTERED, _LEFT, _SENT, _SENT_LEFT, _UNSAVED))
    held = max(0, entered - left)  # never negative: two put threads may store their counts out of order
    return Previous(pid, state == STOPPED, held, min(held, max(0, sent - sent_left)), unsaved)
