"""What a stop with the state disk full could not keep, counted for the next boot (issue 43, "count every
loss"): a small file allocated at start while there is space and rewritten in place at stop (an overwrite of
a block the file already owns needs no free space). What a kill leaves in memory: agent/link/held.py."""

from __future__ import annotations

import os
from pathlib import Path

from agent.logsetup import get_logger

log = get_logger("outbox")


class LostCounter:
    """Results a stop could not keep (the disk full at stop), for the next boot to count. The file is
    allocated at start, while there is space, and rewritten in place at stop: an overwrite of a block the
    file already owns needs no free space."""

    SIZE = 32

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> int:
        """The count the previous stop left (0 if none)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        except OSError as exc:
            log.error("outbox.lost_counter_unreadable", file=str(self.path), error=str(exc))
            return 0
        try:
            count = int(raw.split()[1]) if raw.startswith(b"lost ") else 0
        except (IndexError, ValueError):
            log.error("outbox.lost_counter_unreadable", file=str(self.path), error=f"bad contents {raw[:40]!r}")
            count = 0
        return count

    def allocate(self) -> None:
        """Reset to 0, which (re)allocates the file while there is space for it."""
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        if size != self.SIZE or self.read():
            self.store(0)

    def store(self, count: int) -> bool:
        text = f"lost {count}".encode().ljust(self.SIZE - 1) + b"\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, text, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("outbox.lost_counter_not_written", file=str(self.path), count=count, error=str(exc))
            return False
        return True
