"""Disk full while a signed bundle unpacks (the store on a 4 MiB tmpfs, the bundle 6 MiB unpacked): the
verdict is `rejected` naming the full disk, staging is left empty, the machine is free for the next update,
and nothing half-unpacked reaches the store."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from agent.config import UpdatesConfig
from agent.updates.machine import State
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from full_disk import _mount_tmpfs
from tests.updates.test_updates_inbox_swap import _Idle

import pytest
import subprocess

ROOT = Path(__file__).resolve().parents[2]


def test_a_disk_that_fills_during_unpack_is_a_rejection_with_staging_cleared(tmp_path: Path) -> None:
    from agent.bundle.archive import pack
    from agent.bundle.signing import keygen, sign_bundle

    disk = tmp_path / "small"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        keygen(tmp_path / "k.pem", tmp_path / "k.pub")
        src = tmp_path / "b"
        shutil.copytree(ROOT / "models" / "digits-classifier", src)
        sign_bundle(src, tmp_path / "k.pem")
        archive = pack(src, tmp_path / "b.tar.gz")
        docs: list[dict[str, Any]] = []
        store = BundleStore(disk / "store")
        up = Updater(_Idle(), store, UpdatesConfig(trusted_keys=(tmp_path / "k.pub",)), tmp_path / "state",  # type: ignore[arg-type]
                     lambda: None, docs.append)
        assert up.begin("big", "url") is None
        verdict = up.install(archive, "url", "big")
        assert verdict["state"] == "rejected", verdict
        assert "No space left" in verdict["reason"] or "disk" in verdict["reason"].lower(), verdict["reason"]
        assert up.machine.snapshot.state == State.REJECTED
        assert list(store.staging.iterdir()) == [], list(store.staging.iterdir())
        assert list(store.bundles.iterdir()) == []
        assert up.begin("next", "url") is None  # the machine takes the next update
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
