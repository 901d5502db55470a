"""A restart between the store's commit and the machine's PASSED: the new bundle is committed and serves
after the boot, so the interrupted update's verdict is `committed`, not `rolled_back` (which sent the
operator to re-offer a bundle that anti-downgrade then refuses as not newer)."""

from __future__ import annotations

import json
from pathlib import Path

from agent.updates.machine import STATE_FILE, State, UpdateMachine
from agent.updates.store import BundleStore


def _store_with(tmp_path: Path, tiny_bundle_master: Path) -> tuple[BundleStore, str]:
    store = BundleStore(tmp_path / "store")
    bid = store.import_bundle(tiny_bundle_master)
    return store, bid


def test_killed_after_the_store_committed_the_update_is_committed(tmp_path: Path, tiny_bundle_master: Path) -> None:
    store, bid = _store_with(tmp_path, tiny_bundle_master)
    # what the disk holds after store.commit(bid) and before the PASSED transition was written
    (store.root / STATE_FILE).write_text(json.dumps({"state": "probation", "update": "u2", "origin": "mqtt",
                                                     "bundle": bid, "since": 1.0}))
    assert store.recover() == bid
    snap = UpdateMachine(store.root).resolve_interrupted(committed=store.committed_id)
    assert snap is not None and snap.state == State.COMMITTED, snap
    assert "committed before" in (snap.reason or ""), snap.reason
    assert json.loads((store.root / STATE_FILE).read_text())["state"] == "committed"


def test_killed_in_probation_before_the_commit_is_still_rolled_back(tmp_path: Path, tiny_bundle_master: Path) -> None:
    store, bid = _store_with(tmp_path, tiny_bundle_master)
    (store.root / STATE_FILE).write_text(json.dumps({"state": "probation", "update": "u2", "bundle": "other-id"}))
    snap = UpdateMachine(store.root).resolve_interrupted(committed=store.committed_id)
    assert snap is not None and snap.state == State.ROLLED_BACK, snap
    (store.root / STATE_FILE).write_text(json.dumps({"state": "switching", "update": "u3", "bundle": bid}))
    snap = UpdateMachine(store.root).resolve_interrupted(committed=store.committed_id)
    assert snap is not None and snap.state == State.ROLLED_BACK, snap  # only probation reaches the commit
