"""Two deliveries under the same update id (an `update` command with id "v2" and an MQTT transfer "v2"):
the superseded one's late verdict must not end the delivery that now holds the machine. The machine's
guard matched the update id alone, so the cancelled download's `rejected` moved the machine out of
Receiving and the MQTT transfer died without a verdict of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.config import UpdatesConfig
from agent.updates.machine import State
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from tests.updates.test_updates_inbox_swap import _Idle


def _updater(tmp_path: Path, docs: list[dict[str, Any]]) -> Updater:
    return Updater(_Idle(), BundleStore(tmp_path / "store"), UpdatesConfig(), tmp_path / "state",  # type: ignore[arg-type]
                   lambda: None, docs.append)


def test_a_superseded_download_rejects_only_itself(tmp_path: Path) -> None:
    docs: list[dict[str, Any]] = []
    up = _updater(tmp_path, docs)
    assert up.begin("v2", "url") is None
    cancel = up.machine.cancel
    assert up.begin("v2", "mqtt", offer=True) is None  # the newest offer wins, same id
    assert cancel.is_set()
    up.refuse("v2", "url", "download failed: cancelled: a rollback or a newer offer took the update machine")
    snap = up.machine.snapshot
    assert (snap.state, snap.origin) == (State.RECEIVING, "mqtt"), snap


def test_a_superseded_download_that_completes_does_not_take_the_newer_offer(tmp_path: Path) -> None:
    docs: list[dict[str, Any]] = []
    up = _updater(tmp_path, docs)
    assert up.begin("v2", "url") is None
    assert up.begin("v2", "mqtt", offer=True) is None
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(b"x")
    verdict = up.install(archive, "url", "v2")  # the download finished just as the offer came in
    assert verdict["state"] == "rejected" and "superseded" in verdict["reason"], verdict
    snap = up.machine.snapshot
    assert (snap.state, snap.origin) == (State.RECEIVING, "mqtt"), snap
