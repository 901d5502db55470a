"""The inbox on a full disk: the entry is filed under rejected/ but its .reason.txt cannot be written. That
raised out of `inbox_entry`, so the watcher put the name on its skip list for good: the same name dropped
again once space returned was never looked at (until a restart)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from agent.config import UpdatesConfig
from agent.updates.delivery import watch_inbox
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture
from tests.updates.test_updates_inbox_swap import _Idle
from waiting import wait_until


def test_a_reason_file_the_full_disk_refuses_does_not_blind_the_watcher_to_that_name(
        tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    inbox = small_disk / "inbox"
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True)
    entry = inbox / "junk.tar.gz"
    entry.write_bytes(b"not an archive" * 10)
    verdicts: list[dict[str, Any]] = []

    def publish(doc: dict[str, Any]) -> None:
        if doc["state"] == "rejected" and doc["update"] == entry.name:
            verdicts.append(doc)

    up = Updater(_Idle(), BundleStore(tmp_path / "store"), UpdatesConfig(inbox=inbox), tmp_path / "state",  # type: ignore[arg-type]
                 lambda: None, publish)
    filler = fill(small_disk)
    stop = threading.Event()
    t = threading.Thread(target=watch_inbox, args=(up, stop, 0.05), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(verdicts) == 1 and not entry.exists(), 30), verdicts
        filler.unlink()  # space returns; the operator drops a file of the same name again
        entry.write_bytes(b"still not an archive" * 10)
        assert wait_until(lambda: len(verdicts) == 2, 30), \
            f"the same name dropped after a full disk was never looked at ({len(verdicts)} verdicts)"
        assert wait_until(lambda: not entry.exists(), 10)
    finally:
        stop.set()
        t.join(10)


def test_an_entry_that_could_not_be_filed_and_was_removed_by_hand_is_looked_at_when_dropped_again(
        tmp_path: Path) -> None:
    """The log's fix for an entry that cannot be filed is "remove it by hand"; the name stayed on the
    watcher's skip list, so a bundle dropped later under that name was never looked at."""
    inbox = tmp_path / "inbox"
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True)
    (inbox / "rejected" / "d.tar.gz").write_text("an old verdict")  # a directory cannot replace a file
    (inbox / "d.tar.gz").mkdir()
    verdicts: list[dict[str, Any]] = []
    up = Updater(_Idle(), BundleStore(tmp_path / "store"), UpdatesConfig(inbox=inbox), tmp_path / "state",  # type: ignore[arg-type]
                 lambda: None, lambda doc: verdicts.append(doc) if doc["state"] == "rejected" else None)
    stop = threading.Event()
    t = threading.Thread(target=watch_inbox, args=(up, stop, 0.05), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(verdicts) >= 1, 30), verdicts
        assert (inbox / "d.tar.gz").is_dir()  # not filed: skipped while it is there
        (inbox / "d.tar.gz").rmdir()  # the operator removes it, then drops a file of that name
        (inbox / "d.tar.gz").write_bytes(b"junk" * 10)
        assert wait_until(lambda: not (inbox / "d.tar.gz").exists(), 30), \
            f"a name once unfiled was never looked at again ({len(verdicts)} verdicts)"
        assert len(verdicts) == 2 and "not a regular file" not in verdicts[1]["reason"], verdicts
    finally:
        stop.set()
        t.join(10)
