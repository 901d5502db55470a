"""ServingWatch descriptors when the watch never finishes its constructor (agent/service/serving_ledger.py)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from agent.service import serving_ledger
from agent.service.serving_ledger import ServingWatch


def _open_under(directory: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


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
    with pytest.raises(OSError):
        ServingWatch(tmp_path, "sha", "CPUExecutionProvider:fp32")
    gc.collect()
    assert _open_under(tmp_path) == [], "descriptors left open by a watch that failed to start"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "files left by a watch that failed to start"
