"""ServingWatch descriptors (agent/service/serving_ledger.py): closed when the watch is collected without
end(), once when it ends, and when its constructor fails."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from agent.service import serving_ledger
from agent.service.serving_ledger import ServingWatch


def open_descriptors() -> list[str]:
    """What this process's descriptors point at (an unlinked file ends in " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return out


def _open_under(directory: Path) -> list[str]:
    return [t for t in open_descriptors() if t.startswith(str(directory))]


def _open_files(suffix: str) -> list[str]:
    return [t for t in open_descriptors() if t.removesuffix(" (deleted)").endswith(suffix)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_watch_whose_marker_write_fails_leaves_no_descriptor_lock_or_file(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker's write (a full disk) raises in the constructor after the .lock is flocked and the
    .inflight opened: the new finalizer closes the in-flight descriptor, but the one that closes the lock
    descriptor and removes the .lock/.inflight files was registered after the write, so never: one flocked
    descriptor and two files per failed serving start, for the life of the process."""
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serving_ledger, "write_json_atomic", full)
    # the session opens without its marker (serving.marker_unwritten: review 43b, a drift switch on a full disk
    # must not fail); ended and collected, it leaves nothing behind either
    watch = ServingWatch(tmp_path, "sha", "CPUExecutionProvider:fp32")
    watch.end()
    del watch
    gc.collect()
    assert _open_under(tmp_path) == [], "descriptors left open by a watch that failed to start"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "files left by a watch that failed to start"


def test_a_watch_collected_without_end_closes_its_in_flight_descriptor(tmp_path: Path) -> None:
    """An engine dropped on an error path never calls end(): its marker went with the collected watch,
    but the in-flight record's descriptor stayed open for the life of the process, one per such engine."""
    before = _open_files(".inflight")
    watch = ServingWatch(tmp_path, "sha", "CPUExecutionProvider:fp32")
    watch.opened()
    assert len(_open_files(".inflight")) == len(before) + 1
    del watch
    gc.collect()
    assert _open_files(".inflight") == before, "the collected watch left its in-flight descriptor open"
    assert not list(tmp_path.glob("*.inflight")) and not list(tmp_path.glob(f"{serving_ledger.PREFIX}*.json"))


def test_end_closes_the_descriptor_once_and_a_later_collect_closes_nothing_else(tmp_path: Path) -> None:
    watch = ServingWatch(tmp_path, "sha", "CPUExecutionProvider:fp32")
    fd = watch._flight_fd
    assert fd is not None
    watch.end()
    other = os.open(tmp_path / "reused", os.O_RDWR | os.O_CREAT)  # likely the number just freed
    try:
        del watch
        gc.collect()
        os.fstat(other)  # still open: the finalizer did not close the reused number a second time
    finally:
        os.close(other)
