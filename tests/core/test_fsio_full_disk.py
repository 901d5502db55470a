"""`fsio.write_atomic` on a full disk: each ENOSPC left its `.<name>.<pid>.tmp` behind (a partial file that
took the space the next write needed, and was never removed)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.fsio import write_atomic
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture


def test_a_write_the_full_disk_refuses_leaves_no_tmp_file(small_disk: Path) -> None:  # noqa: F811
    target = small_disk / "state" / "doc.json"
    write_atomic(target, b"the old document")
    fill(small_disk)
    with pytest.raises(OSError) as err:
        write_atomic(target, b"x" * (1 << 20))
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in target.parent.iterdir()) == ["doc.json"], "a .tmp file was left behind"
    assert target.read_bytes() == b"the old document"
