"""The outbox's clock: what `created` is stamped with and the age bound measures against.

Within a process: wall time read once at start plus the boot clock since (CLOCK_BOOTTIME: monotonic, and it
counts a suspend as time passing), so a wall-clock step neither ages nor rejuvenates anything. Across a
restart within one machine boot the stamps of the previous process are moved into this one's frame by the
difference of the two processes' offsets (wall clock at start less boot clock at start): a process that
started with its clock days behind (no RTC, before NTP) stamped its backlog days in the past, and the next
process, after NTP stepped the clock, would otherwise drop that whole backlog as too old. Across a reboot
the wall clock is the only measure of the time the device was down.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.logsetup import get_logger

log = get_logger("outbox")

# meta keys (integers): the writing process's machine boot (a hash of its id) and its offset in milliseconds
BOOT_KEY, OFFSET_KEY = "clock_boot", "clock_offset_ms"


def _boottime() -> float:
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux: monotonic (a suspend then does not age anything)
        return time.monotonic()


def machine_boot() -> int:
    """This machine boot's id as a positive integer (0: unknown)."""
    try:
        return int(Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:15], 16)
    except (OSError, ValueError):
        return 0


class StepSafeClock:
    """Wall time at start plus the boot clock since (see the module docstring)."""

    def __init__(self) -> None:
        self._wall0, self._boot0 = time.time(), _boottime()

    def __call__(self) -> float:
        return self._wall0 + (_boottime() - self._boot0)

    @property
    def offset(self) -> float:
        """Wall clock less boot clock, at this process's start: its stamps are boot clock plus this."""
        return self._wall0 - self._boot0


def recorded(clock: StepSafeClock, meta: Any) -> bool:
    """The stored frame is this process's already (same machine boot, offset within a second): nothing to write."""
    boot = machine_boot()
    return bool(boot) and meta(BOOT_KEY) == boot and abs(meta(OFFSET_KEY) - round(clock.offset * 1000)) < 1000


def record(db: Any, clock: StepSafeClock) -> None:
    """This process's machine boot and offset into meta (inside the caller's transaction: the rows it writes are
    stamped in this frame). Two rows, once per process that writes rows."""
    for key, value in ((BOOT_KEY, machine_boot()), (OFFSET_KEY, round(clock.offset * 1000))):
        db.execute("INSERT INTO meta(key, value) VALUES(?, ?) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))


def rebase_stamps(db: Any, clock: StepSafeClock, meta: Any) -> bool:
    """Move the stored stamps into this process's frame when the previous writer ran in this machine boot
    with another offset (its wall clock was stepped since), recording this frame with them (one transaction).
    `meta(key) -> int`, `db` the outbox's connection. True when the stored frame is this process's (nothing
    to record before this process's first rows); a full disk leaves the stamps as they are (said)."""
    boot = machine_boot()
    if not boot or meta(BOOT_KEY) != boot:
        return False  # another machine boot (or none recorded): the wall clock is the only measure
    shift = (round(clock.offset * 1000) - meta(OFFSET_KEY)) / 1000.0
    if abs(shift) < 1.0:
        return True
    try:
        db.execute("BEGIN")
        n = db.execute("UPDATE messages SET created = created + ?", (shift,)).rowcount
        record(db, clock)
        db.execute("COMMIT")
    except Exception as exc:  # noqa: BLE001 -- sqlite3's errors and OSError: a full disk at start
        try:
            db.execute("ROLLBACK")
        except Exception:  # noqa: BLE001 -- no transaction left to roll back
            pass
        log.warning("outbox.clock_not_rebased", error=str(exc), shift_s=round(shift, 3),
                    detail="the stamps stay as they are: a backlog may be aged by the clock's step")
        return False
    if n:
        log.warning("outbox.clock_stepped", shift_s=round(shift, 3), rows=n,
                    detail="the wall clock was stepped since the previous process stamped its backlog (same machine "
                           "boot): its stamps are moved by the step, never aged by it")
    return True
