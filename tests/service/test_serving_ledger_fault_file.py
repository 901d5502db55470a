"""The serving process's fault file and in-flight record, attacked where the blame could go wrong: another
agent's boot on the same state dir recovering the fault files at the moment this process creates its own,
and more threads in flight than a short record could name."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.service import serving_ledger
from agent.service.serving_ledger import ServingWatch

ROOT = Path(__file__).resolve().parents[2]

# argv: state dir. Another process's recover() runs between the fault file's creation and its flock.
RECOVER_IN_BETWEEN = """
import fcntl, os, sys
from pathlib import Path
from agent.service import serving_ledger as sl
d = Path(sys.argv[1])
real, hit = fcntl.flock, []
def flock(fd, op):
    name = os.readlink(f"/proc/self/fd/{fd}")
    if not hit and name.endswith(sl.FAULT_SUFFIX) and sl._fault_file is None:
        hit.append(name)
        sl._crashed_threads(d)  # another agent's boot on this state dir, at the worst moment
    return real(fd, op)
fcntl.flock = flock
sl.watch_faults(d)
assert hit, "the fault file was never locked"
f = sl._fault_file
assert f is not None, "no fault file"
path = Path(f.name)
print(path.exists() and os.stat(path).st_ino == os.fstat(f.fileno()).st_ino)
"""


def test_a_fault_file_recovered_by_another_boot_while_it_is_created_is_created_again(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", RECOVER_IN_BETWEEN, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True", "faulthandler writes into a file that another boot removed"


def test_the_in_flight_record_names_every_thread_of_a_busy_session(tmp_path: Path) -> None:
    watch = ServingWatch(tmp_path, "sha", "CPUExecutionProvider:int8")
    watch.opened()
    n, inside, release = 16, threading.Barrier(17), threading.Event()
    idents: list[int] = []

    def worker() -> None:
        idents.append(threading.get_ident())
        watch.before()
        inside.wait()
        release.wait()
        watch.after({})

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        inside.wait(30)
        raw = watch.path.with_suffix(".inflight").read_bytes()
        assert serving_ledger.flight_threads(raw) == set(idents), "threads missing or a thread id cut short"
    finally:
        release.set()
        for t in threads:
            t.join(30)
        watch.end()


def test_an_ended_watch_never_writes_its_record_into_a_reused_descriptor(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A swap ends the old watch while the old engine still finishes frames on its workers: a record written
    as the descriptor closed went into whatever file opened next under its number (the new marker's record)."""
    watch = ServingWatch(tmp_path, "sha", "CPUExecutionProvider:int8")
    watch.opened()
    real, writing, reused = os.pwrite, threading.Event(), threading.Event()

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if threading.current_thread().name == "old-worker":
            writing.set()
            reused.wait(2)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    worker = threading.Thread(target=watch.before, name="old-worker")
    worker.start()
    assert writing.wait(30)
    ender = threading.Thread(target=watch.end)
    ender.start()
    ender.join(0.3)
    fds = [os.open(tmp_path / f"next-file-{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]  # its lock's too
    try:
        reused.set()
        worker.join(30)
        ender.join(30)
        assert [os.fstat(fd).st_size for fd in fds] == [0, 0, 0], "the old watch's record went into another file"
    finally:
        for fd in fds:
            os.close(fd)


# argv: state dir. A filesystem without flock (ENOLCK): no fault file can be held, none may be left behind.
NO_LOCKS = """
import errno, fcntl, os, sys
from pathlib import Path
from agent.service import serving_ledger as sl
def flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = flock
for _ in range(3):  # boot, swap, swap
    sl.watch_faults(Path(sys.argv[1]))
print(sl._fault_file is None)
"""


def test_a_fault_file_that_cannot_be_locked_is_not_left_behind(tmp_path: Path) -> None:
    for _ in range(2):  # two restarts
        proc = subprocess.run([sys.executable, "-c", NO_LOCKS, str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
    assert not list(tmp_path.glob("serving-*")), "an unlockable fault file stays forever (recover cannot lock it)"
