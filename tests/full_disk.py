"""A real full disk for the tests: a small tmpfs (root only) and a filler to its last byte. Shared by the
full-disk tests of the outbox, the boot, fsio, the evidence switch and the update deliveries."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "small"
    if not _mount_tmpfs(d, "8m"):
        pytest.skip("needs root to mount a small tmpfs (the full-disk tests use a real filesystem)")
    try:
        yield d
    finally:
        # a boot on the full disk keeps its proof's state in memory (agent.service.boot.memory_dir, kept across
        # starts by design): the test's own go with it, never left in /dev/shm
        from agent.service.boot import memory_dir

        for state in [p for p in d.iterdir() if p.is_dir()] if d.is_dir() else []:
            shutil.rmtree(memory_dir(state), ignore_errors=True)
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(disk: Path) -> Path:
    """Fill the filesystem to its last byte; returns the filler file (delete it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    probe = disk / "probe"
    with pytest.raises(OSError):
        with open(probe, "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
            os.fsync(f.fileno())
    probe.unlink(missing_ok=True)
    return filler
