"""A simulated fleet in one process: its devices (agent.fleet.simulator) on one epoll loop thread for all their MQTT
clients and one worker pool, one state root with one seed bundle copy, started, summed up and closed together.
"""

from __future__ import annotations

import contextlib
import selectors
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from agent.bundle.load import load_bundle
from agent.config import UpdatesConfig
from agent.fleet.sim_groups import GroupProfile, assign_fates
from agent.fleet.simulator import SimDevice
from agent.updates.store import bundle_id


class SocketLoop:
    """One epoll loop for many paho clients (paho's external-loop callbacks): one thread, not one per client."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.clients: list[paho.Client] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sim-loop", daemon=True)

    def attach(self, client: paho.Client) -> None:
        client.on_socket_open = self._open
        client.on_socket_close = self._close
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._done_write
        with self.lock:
            self.clients.append(client)

    def _open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with self.lock:
            self.sel.register(sock, selectors.EVENT_READ, client)

    def _close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with self.lock, contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)

    def _want_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with self.lock, contextlib.suppress(KeyError, ValueError):
            self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    def _done_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with self.lock, contextlib.suppress(KeyError, ValueError):
            self.sel.modify(sock, selectors.EVENT_READ, client)

    def _run(self) -> None:
        next_misc = next_ping = 0.0
        while not self.stop.is_set():
            with self.lock:
                empty = not self.sel.get_map()
            events = [] if empty else self.sel.select(0.1)
            if empty:
                time.sleep(0.05)
            for key, mask in events:
                c: paho.Client = key.data
                if mask & selectors.EVENT_READ:
                    c.loop_read()
                if mask & selectors.EVENT_WRITE:
                    c.loop_write()
            if time.monotonic() >= next_misc:
                with self.lock:
                    clients = list(self.clients)
                ping = time.monotonic() >= next_ping
                for c in clients:
                    # paho unregisters the write interest after draining, racing a publisher thread that queued
                    # a packet just then (the interest is registered once, not per packet): flush strays here
                    if c.want_write():
                        c.loop_write()
                    if ping:  # keep-alive pings and retries
                        c.loop_misc()
                if ping:
                    next_ping = time.monotonic() + 1.0
                next_misc = time.monotonic() + 0.25


class SimFleet:
    """N simulated devices in this process: one socket loop, one worker pool, one state root."""

    def __init__(self, host: str, port: int, groups: list[GroupProfile], seed_bundle: Path, trusted_keys: list[Path],
                 state_root: Path, seed: int = 1, root: str = "edge", workers: int = 64, protocol: str = "5"):
        self.host, self.port, self.seed, self.root = host, port, seed, root
        self.protocol = protocol  # "5" or "3.1.1" (--mqtt-protocol): a broker without MQTT 5, e.g. aedes
        self.state_root = state_root
        self.stop = threading.Event()
        self.loop = SocketLoop()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-job")
        self.connected: set[str] = set()
        self.seed_bundle = load_bundle(seed_bundle, check_contracts=False)
        self.seed_id = bundle_id(self.seed_bundle)
        self.seed_copy = state_root / "_seed" / self.seed_id  # one copy on the state root's filesystem, then links
        if not self.seed_copy.exists():
            shutil.copytree(seed_bundle, self.seed_copy)
        self.updates = UpdatesConfig(enabled=True, trusted_keys=tuple(trusted_keys), probation_s=1.0,
                                     probation_frames=40, keep=3)
        self.devices = [SimDevice(self, d, g, f, slow, fall) for d, g, f, slow, fall in assign_fates(groups, seed)]

    def start(self, timeout: float = 120.0) -> SimFleet:
        self.loop.thread.start()
        for d in self.devices:
            d.connect()
        deadline = time.monotonic() + timeout
        while len(self.connected) < len(self.devices):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.connected)} of {len(self.devices)} simulated devices connected "
                                   f"within {timeout:g} s")
            time.sleep(0.05)
        for d in self.devices:
            if d.fate == "offline":  # seen once (retained facts), then gone for good: its last will stands
                d._link_dropped = True
                d.lose_link()
        return self

    def close(self) -> None:
        self.stop.set()
        for d in self.devices:
            with contextlib.suppress(Exception):
                d.client.publish(d.topics.availability, d._availability("stopped", d.session), qos=1, retain=True)
                d.client.disconnect()
        time.sleep(0.5)
        self.loop.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def summary(self) -> dict[str, Any]:
        by: dict[str, dict[str, int]] = {}
        for d in self.devices:
            com = d.store.committed_id or "?"
            g = by.setdefault(d.group.name, {})
            g[com] = g.get(com, 0) + 1
        return {"devices": len(self.devices), "committed_by_group": by,
                "update_commands": {d.id: d.update_commands for d in self.devices if d.update_commands},
                "rollback_commands": {d.id: d.rollback_commands for d in self.devices if d.rollback_commands}}
