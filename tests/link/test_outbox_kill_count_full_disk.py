"""Review of issue 43 point 4 ("count every loss: a loss ... is counted where the next boot and health see it"),
two kills in a row while the outbox cannot write its `dropped` total (the state disk full).

`Outbox.__init__` reads the held counter the killed process left (agent/link/held.py) and resets the mapped file to
this process's zeros at once (`HeldCounter._open`), then adds the previous process's count to `dropped` with
`_count_drops`, which on a full disk keeps it in memory only (the INSERT into meta fails). The lost_at_stop path
resets its file only once the count is persisted ("persisted first, then the file is reset"); the held path does
did not. So when the second process was killed too, the first process's loss was in no file: the third boot's
`dropped` lacked it. Now a drop count the disk cannot take is kept in the held file (slot `unsaved`) until it can.

In process (the agent-level version is blocked today by tests/service/test_boot_full_disk_with_outbox.py: a boot on a full disk
holding an outbox exits before it gets here): three Outbox objects on one file, a "kill" being the end of an
object without `close()` (its counters stay in the mapped file, as after SIGKILL); the second one's meta writes fail
as on a full disk."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link import outbox as outbox_mod
from agent.link.outbox import Outbox


class _FullDiskMeta:
    """The connection, but a write of the `dropped` total fails as on a full disk."""

    def __init__(self, db) -> None:
        self._db = db

    def execute(self, sql, *a):
        if sql.lstrip().upper().startswith("INSERT INTO META"):
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *a)

    def __getattr__(self, name):
        return getattr(self._db, name)


def _killed(box: Outbox) -> None:
    """SIGKILL: nothing of close() runs; the mapped counters stay as they were."""
    box.db.close()


def test_a_kill_counted_while_the_disk_is_full_survives_a_second_kill(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "outbox.sqlite"
    box1 = Outbox(path, OutboxConfig(memory_messages=100))
    box1.on_connected()
    for i in range(10):
        box1.put("t", json.dumps({"seq": i}).encode(), 1)
    box1.pump(lambda m: None, 0)  # nothing may be sent: 10 held only in memory
    _killed(box1)

    real_connect = sqlite3.connect
    monkeypatch.setattr(outbox_mod.sqlite3, "connect", lambda *a, **k: _FullDiskMeta(real_connect(*a, **k)))
    box2 = Outbox(path, OutboxConfig(memory_messages=100))
    assert box2.lost_at_previous_kill == 10 and box2.dropped == 10  # counted, in memory
    _killed(box2)  # killed before any drop could be written

    monkeypatch.setattr(outbox_mod.sqlite3, "connect", real_connect)
    box3 = Outbox(path, OutboxConfig(memory_messages=100))
    dropped = box3.dropped
    box3.close()
    assert dropped >= 10, f"boot 3's dropped = {dropped}: boot 1's 10 lost results are counted nowhere"
