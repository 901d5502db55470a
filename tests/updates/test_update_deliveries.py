"""The three delivery paths (MQTT chunks, a URL, an inbox) implement one interface and one thread model
(agent.updates.intake): each has an origin and a loop that one starter runs on its own thread until the
agent's stop event."""

from __future__ import annotations

import threading
from pathlib import Path

from agent.config import UpdatesConfig
from agent.updates.delivery import ChunkReceiver, Delivery, Downloader, InboxWatcher, start_deliveries
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from tests.updates.test_updates_inbox_swap import _Idle


def test_every_delivery_path_is_one_interface_whose_loops_start_and_stop_together(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    cfg = UpdatesConfig(inbox=inbox, transfer_idle_s=1.0)
    up = Updater(_Idle(), BundleStore(tmp_path / "store"), cfg, tmp_path / "state",  # type: ignore[arg-type]
                 lambda: None, lambda doc: None)
    paths: list[Delivery] = [ChunkReceiver(up), Downloader(up), InboxWatcher(up, period_s=0.05)]
    assert all(isinstance(p, Delivery) for p in paths)
    assert [p.origin for p in paths] == ["mqtt", "url", "inbox"]  # the origin every status of theirs names
    stop = threading.Event()
    threads = start_deliveries(paths, stop)
    assert [t.name for t in threads] == ["delivery-mqtt", "delivery-url", "delivery-inbox"]
    assert all(t.daemon for t in threads)
    assert _wait_dirs(inbox)  # the inbox's loop is running
    stop.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), t.name


def _wait_dirs(inbox: Path) -> bool:
    """The watcher makes done/ and rejected/ as it starts: polled, bounded at 30 s."""
    ready = threading.Event()
    for _ in range(600):
        if (inbox / "done").is_dir() and (inbox / "rejected").is_dir():
            ready.set()
            break
        ready.wait(0.05)
    return ready.is_set()
