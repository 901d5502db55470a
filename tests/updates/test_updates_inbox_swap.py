"""An inbox entry swapped for a FIFO after the watcher's lstat and before the archive is opened: the open
must not block (it held the update machine and the operation slot until someone wrote to the FIFO)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Iterator

from agent.config import UpdatesConfig
from agent.updates.delivery import inbox_entry
from agent.updates.machine import State
from agent.updates.store import BundleStore
from agent.updates.updater import Updater


class _Idle:
    """The serving side, idle: the entry is refused long before anything would be switched."""

    bundle = None

    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[None]:
        yield

    def stopping(self) -> bool:
        return False


def test_an_entry_swapped_for_a_fifo_after_lstat_is_rejected_without_blocking(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True)
    entry = inbox / "swap.tar.gz"
    entry.write_bytes(b"not really an archive" * 100)
    swapped = threading.Event()

    def publish(doc: dict[str, Any]) -> None:
        # after the updater's lstat, before the archive is opened: the attacker's moment
        if doc["step"] == "unpacking" and not swapped.is_set() and doc["update"] == entry.name:
            os.mkfifo(tmp_path / "fifo")
            os.replace(tmp_path / "fifo", entry)
            swapped.set()

    up = Updater(_Idle(), BundleStore(tmp_path / "store"), UpdatesConfig(), tmp_path / "state",  # type: ignore[arg-type]
                 lambda: None, publish)
    out: list[dict[str, Any] | None] = []
    t = threading.Thread(target=lambda: out.append(inbox_entry(up, inbox, entry)), daemon=True)
    t.start()
    t.join(20)
    blocked = t.is_alive()
    if blocked:  # let the blocked open() return, so the thread ends
        fd = os.open(entry, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(20)
    assert swapped.is_set()
    assert not blocked, "inbox_entry blocked in open() on a FIFO swapped in after lstat"
    assert out and out[0] is not None and out[0]["state"] == "rejected", out
    assert up.machine.snapshot.state == State.REJECTED  # the machine is free for the next update


def test_across_file_systems_the_entry_is_copied_through_a_non_blocking_descriptor(tmp_path: Path) -> None:
    """No hard link across file systems: a FIFO, a symlink and an oversized file are refused without
    blocking; a regular file is copied whole."""
    import pytest

    from agent.errors import UpdateRejected
    from agent.updates.delivery import _take_entry

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm) to force the copy path")
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as d:
        inbox = Path(d)
        os.mkfifo(inbox / "fifo.tar.gz")
        (inbox / "link.tar.gz").symlink_to(inbox / "nowhere")
        (inbox / "big.tar.gz").write_bytes(b"x" * 2048)
        (inbox / "ok.tar.gz").write_bytes(b"y" * 1000)
        for name, why in (("fifo.tar.gz", "not a regular file"), ("link.tar.gz", "cannot be opened"),
                          ("big.tar.gz", "max_bundle_bytes")):
            work = tmp_path / name
            work.mkdir()
            with pytest.raises(UpdateRejected, match=why):
                _take_entry(inbox / name, work, 1024)
        work = tmp_path / "ok"
        work.mkdir()
        assert _take_entry(inbox / "ok.tar.gz", work, 1024).read_bytes() == b"y" * 1000
