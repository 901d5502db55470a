"""What the outbox holds only in memory, counted where a kill cannot erase it (issue 43, "count every loss").

The outbox keeps up to `outbox.memory_messages` results in memory while the broker keeps up (no disk writes:
flash wear, speed). A clean stop spills them or counts what it cannot keep (`lost_at_stop`); a SIGKILL, the
OOM killer or a stop time-out ends the process with no word, and those results vanished uncounted (the chaos
script: 10 over 30 kills). So the outbox keeps a few counters in a small file of the state directory mapped
into memory: a store into the mapping is a store into the kernel's page cache, which outlives the process
(SIGKILL, OOM) though not a power cut (the kernel writes the page back within seconds, not at each store).
The hot path pays one 8-byte store per result, not a system call.

Layout (little-endian u64 at fixed offsets, 64 bytes): magic, pid, state (0 running, 1 stopped cleanly),
entered (results that entered memory), left (results that left memory: acknowledged, spilled to disk, or
dropped and counted), sent (of those that entered, sent once), sent_left (of those that left, sent once).
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
import struct
from dataclasses import dataclass
from pathlib import Path

from agent.logsetup import get_logger

log = get_logger("outbox")

MAGIC = b"EAHELD01"
SIZE = 64
_U64 = struct.Struct("<Q")
_PID, _STATE, _ENTERED, _LEFT, _SENT, _SENT_LEFT = 8, 16, 24, 32, 40, 48
RUNNING, STOPPED = 0, 1


@dataclass(frozen=True)
class Previous:
    """What the previous process left in the file."""

    pid: int
    clean: bool  # it stopped cleanly (what it could not keep is in `lost_at_stop`)
    held: int  # results held only in memory when it ended
    unacknowledged: int  # of those, sent once and never acknowledged


class HeldCounter:
    """The counters of this process, in a mapped file; `previous` is what the last process left."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.previous: Previous | None = None
        self._map: mmap.mmap | None = None
        self._entered = itertools.count(1)  # next() is atomic under the GIL: put may run on several threads
        self._left = self._sent = self._sent_left = 0
        try:
            self._open()
        except (OSError, ValueError) as exc:
            log.error("outbox.held_counter_unavailable", file=str(path), error=str(exc),
                      detail="results held only in memory are not counted if this process is killed")
            self._map = None

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
        _U64.pack_into(m, _PID, os.getpid())
        m.flush()  # a power cut later must not bring back the previous process's counts

    # -- hot path: one 8-byte store into the page cache each ----------------------------------------------
    def entered(self) -> None:
        if self._map is not None:
            _U64.pack_into(self._map, _ENTERED, next(self._entered))

    # -- under the outbox lock ------------------------------------------------------------------------------
    def left(self, n: int, sent: int) -> None:
        """`n` results left memory (acknowledged, on disk, or dropped and counted), `sent` of them sent once."""
        if self._map is not None and n:
            self._left += n
            _U64.pack_into(self._map, _LEFT, self._left)
            if sent:
                self._sent_left += sent
                _U64.pack_into(self._map, _SENT_LEFT, self._sent_left)

    def sent(self, n: int) -> None:
        """`n` results from memory sent for the first time."""
        if self._map is not None and n:
            self._sent += n
            _U64.pack_into(self._map, _SENT, self._sent)

    def stopped(self) -> None:
        """A clean stop: what memory still holds is counted by `lost_at_stop`, not again by the next boot."""
        if self._map is not None:
            _U64.pack_into(self._map, _STATE, STOPPED)
            try:
                self._map.flush()
            except OSError:  # the state reached the page cache; only a power cut now could lose it
                pass
            self._map.close()
            self._map = None


def _parse(raw: bytes) -> Previous:
    pid, state, entered, left, sent, sent_left = (_U64.unpack_from(raw, o)[0]
                                                  for o in (_PID, _STATE, _ENTERED, _LEFT, _SENT, _SENT_LEFT))
    held = max(0, entered - left)  # never negative: two put threads may store their counts out of order
    return Previous(pid, state == STOPPED, held, min(held, max(0, sent - sent_left)))
