"""Inbox delivery: a `.tar.gz` renamed into `updates.inbox`, refused by lstat unless a regular file, taken
under the agent's own staging name, installed on the watcher's thread and filed under done/ or rejected/."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

from agent.errors import AgentError, UpdateRejected
from agent.logsetup import get_logger
from agent.updates.intake import space_refusal
from agent.updates.updater import Updater, file_kind

log = get_logger("delivery")


def _file_away(inbox: Path, entry: Path, verdict: dict[str, Any]) -> None:
    committed = verdict.get("state") == "committed"
    target = inbox / ("done" if committed else "rejected") / entry.name
    try:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)  # moves the entry itself: a symlink, a FIFO or a directory as it is
    except OSError as exc:
        log.error("inbox.not_filed", entry=entry.name, error=str(exc),
                  fix="remove the entry by hand: the watcher skips it while it is there")
        raise
    if not committed:
        try:  # filed already: a reason the disk cannot take is logged (and published), never a stuck name
            target.with_name(target.name + ".reason.txt").write_text(str(verdict.get("reason")) + "\n")
        except OSError as exc:
            log.error("inbox.reason_not_written", entry=entry.name, error=str(exc), reason=verdict.get("reason"))


def _take_entry(entry: Path, work: Path, limit: int, min_free: int = 0) -> Path:
    """The entry under a name in `work`: a hard link (the same inode, no copy; a FIFO or a symlink linked
    here is still refused by the updater's lstat), or across file systems a copy through a descriptor
    opened without following a link and without blocking on a FIFO, bounded by `limit`. Either way its
    unpacked copy (and a copy of the archive) must fit first."""
    dest = work / "bundle.tar.gz"
    size = entry.lstat().st_size
    if size > limit:
        raise UpdateRejected(f"{entry.name}: {size} bytes is over updates.max_bundle_bytes {limit}")
    try:
        os.link(entry, dest, follow_symlinks=False)
    except OSError:
        pass  # another file system, or protected_hardlinks: copy
    else:
        if (why := space_refusal(entry.name, size, work, min_free, copies=1)) is not None:
            raise UpdateRejected(f"{why}; refused before unpacking")
        return dest
    if (why := space_refusal(entry.name, size, work, min_free)) is not None:
        raise UpdateRejected(f"{why}; refused before copying")
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UpdateRejected(f"{entry.name}: cannot be opened as a regular file ({exc}); refused") from exc
    with open(fd, "rb") as src:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UpdateRejected(f"{entry.name}: not a regular file ({file_kind(st.st_mode)}); refused before reading")
        copied = 0
        with open(dest, "xb") as out:
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > limit:
                    raise UpdateRejected(f"{entry.name}: over updates.max_bundle_bytes {limit}")
                out.write(chunk)
    return dest


def inbox_entry(updater: Updater, inbox: Path, entry: Path) -> dict[str, Any] | None:
    """One inbox entry to its verdict, filed under done/ or rejected/; None when the machine is busy (the
    entry stays for the next pass). An entry that is not a regular file is refused by lstat, never opened."""
    name = entry.name[:200]
    try:
        st = entry.lstat()
    except FileNotFoundError:
        return None  # gone between the listing and now
    if not stat.S_ISREG(st.st_mode):
        verdict = updater.status(name, "inbox", "rejected",
                                 reason=f"{name}: not a regular file ({file_kind(st.st_mode)}); refused before opening")
    else:
        busy = updater.begin(name, "inbox")
        if busy is not None:
            return None
        work: Path | None = None
        try:
            # the entry can be swapped (for a FIFO, a symlink) after this lstat: the updater reads it only
            # under a name in the agent's own staging, which nobody else can swap
            work = updater.store.new_staging("inbox-")
            taken = _take_entry(entry, work, updater.cfg.max_bundle_bytes, updater.cfg.min_free_bytes)
            verdict = updater.install(taken, "inbox", name)
        except AgentError as exc:
            verdict = updater.refuse(name, "inbox", str(exc))
        except Exception as exc:
            log.exception("inbox.entry_failed", entry=name)
            verdict = updater.refuse(name, "inbox", f"{type(exc).__name__}: {exc}")
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
    _file_away(inbox, entry, verdict)
    return verdict


class InboxWatcher:
    """The inbox as a delivery (agent.updates.intake.Delivery): its loop polls the folder and installs each
    whole `.tar.gz` on its own thread, one at a time."""

    origin = "inbox"

    def __init__(self, updater: Updater, period_s: float = 1.0):
        self.updater, self.period_s = updater, period_s

    def run(self, stop: threading.Event) -> None:
        watch_inbox(self.updater, stop, self.period_s)


def watch_inbox(updater: Updater, stop: threading.Event, period_s: float = 1.0) -> None:
    inbox = updater.cfg.inbox
    if inbox is None:
        return
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True, exist_ok=True)
    # entries that could not be moved away: skipped, not retried in a loop; by identity, not by name, so the
    # same name removed by hand and dropped again (a new file) is looked at
    unfiled: dict[str, tuple[int, ...]] = {}
    while not stop.wait(period_s):
        try:
            entries = sorted(inbox.glob("*.tar.gz"))  # copy as .part, then rename: only whole files match
        except OSError as exc:
            log.error("inbox.unreadable", inbox=str(inbox), error=str(exc))
            continue
        listed = {e.name for e in entries}
        unfiled = {k: v for k, v in unfiled.items() if k in listed}  # bounded by what is there now
        for entry in entries:
            if stop.is_set():
                break
            if entry.name in unfiled:
                if _identity(entry) == unfiled[entry.name]:
                    continue
                del unfiled[entry.name]
            seen = _identity(entry)  # before it is handled: the verdict goes out before a failed move, and the
            try:                     # name may hold a new file by the time the failure is caught
                inbox_entry(updater, inbox, entry)
            except Exception:  # one bad entry never ends the watcher
                log.exception("inbox.entry_failed", entry=entry.name[:200])
                unfiled[entry.name] = seen


def _identity(entry: Path) -> tuple[int, ...]:
    try:
        st = entry.lstat()
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns)

