"""Every delivery path asks for the space before its first byte: only the MQTT offer did, and a URL or an
inbox bundle larger than the free disk was written until the disk was full (a real 8 MiB tmpfs here)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.config import UpdatesConfig
from agent.updates.delivery import Downloader, inbox_entry
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from slow_servers import tcp_server
from full_disk import small_disk  # noqa: F401 - small_disk is a fixture

BIG = 12 * 2**20  # over the 8 MiB disk, under updates.max_bundle_bytes


def _updater(store: Path, state: Path, **cfg: Any) -> tuple[Updater, list[dict[str, Any]]]:
    said: list[dict[str, Any]] = []
    up = Updater(None, BundleStore(store), UpdatesConfig(min_free_bytes=0, **cfg), state,  # type: ignore[arg-type]
                 lambda: None, said.append)
    return up, said


def test_a_url_bundle_larger_than_the_free_disk_is_refused_before_a_byte_is_written(
        tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    def serve(conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {BIG}\r\n\r\n".encode() + b"\0" * BIG)
        except OSError:
            pass
        finally:
            conn.close()

    srv = tcp_server(serve, threaded=True)
    up, _ = _updater(small_disk / "store", tmp_path / "state", allow_http=True)
    dest = small_disk / "bundle.tar.gz"
    try:
        with pytest.raises(ValueError, match="does not fit"):
            Downloader(up)._download(f"http://127.0.0.1:{srv.getsockname()[1]}/b.tar.gz", dest, threading.Event())
    finally:
        srv.close()
    assert not dest.exists(), f"{dest.stat().st_size} bytes written before the refusal"


def test_an_inbox_bundle_larger_than_the_free_disk_is_refused_before_it_is_copied(
        tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    inbox = tmp_path / "inbox"
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True)
    entry = inbox / "big.tar.gz"
    entry.write_bytes(os.urandom(BIG))
    up, _ = _updater(small_disk / "store", tmp_path / "state", inbox=inbox)
    verdict = inbox_entry(up, inbox, entry)
    assert verdict is not None and verdict["state"] == "rejected"
    assert "does not fit" in verdict["reason"] and "refused before copying" in verdict["reason"], verdict
    assert (inbox / "rejected" / "big.tar.gz").exists()


def test_a_refused_offer_keeps_its_reason_after_the_pushers_done(tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    """After a refused offer the pusher's `done` published "done for an unknown transfer", and the retained
    update/status ended on that instead of the reason (here: the disk)."""
    from agent.updates.delivery import ChunkReceiver

    up, said = _updater(small_disk / "store", tmp_path / "state")
    rx = ChunkReceiver(up)
    rx.on_offer({"transfer": "t1", "size": BIG, "sha256": "0" * 64, "chunk_size": 65536})
    rx.on_done({"transfer": "t1"})
    assert [d["state"] for d in said] == ["rejected", "rejected"]
    assert "does not fit" in said[-1]["reason"], said[-1]
