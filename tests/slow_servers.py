"""Hostile servers on 127.0.0.1 for download tests: each answers with a head, then trickles one byte at
a time (each byte well inside a per-read timeout), so only a total deadline can end the download."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Callable


def tcp_server(handle: Callable[[socket.socket], None], threaded: bool = False) -> socket.socket:
    """A raw TCP server on 127.0.0.1: `handle(conn)` for each connection (on its own thread if `threaded`),
    until the returned listening socket is closed. The handler closes what it is given."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            if threaded:
                threading.Thread(target=handle, args=(conn,), daemon=True).start()
            else:
                handle(conn)

    threading.Thread(target=serve, daemon=True).start()
    return srv


class Trickle:
    """A raw TCP server: reads the request, sends `head`, then `byte` every `interval` s, `count` times."""

    def __init__(self, head: bytes, byte: bytes, interval: float, count: int) -> None:
        self.head, self.byte, self.interval, self.count = head, byte, interval, count
        self.stop = threading.Event()
        self.srv = tcp_server(self._trickle, threaded=True)
        self.port = self.srv.getsockname()[1]

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(self.head)
            for _ in range(self.count):
                if self.stop.is_set():
                    break
                conn.sendall(self.byte)
                time.sleep(self.interval)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.srv.close()


def header_trickle() -> Trickle:
    """An HTTP status line, then one header byte every 0.5 s, for minutes (a header slow-loris)."""
    return Trickle(b"HTTP/1.1 200 OK\r\nX-Slow: ", b"a", 0.5, 600)


def handshake_trickle() -> Trickle:
    """A TLS record header announcing 16 KiB of handshake, then one byte of it every 0.3 s."""
    return Trickle(b"\x16\x03\x03\x40\x00", b"\x00", 0.3, 2000)


def timed_download(tmp: Path, url: str, deadline_s: float, *stop_after: Trickle | socket.socket) -> tuple[float, list[BaseException]]:
    """The agent's Downloader on `url` under `deadline_s` (per-read timeout 30 s): how long it was held,
    and what it raised. The servers in `stop_after` are closed once it returned (or was given up on)."""
    from agent.config import UpdatesConfig
    from agent.updates.delivery import Downloader
    from agent.updates.store import BundleStore
    from agent.updates.updater import Updater

    cfg = UpdatesConfig(download_deadline_s=deadline_s, download_timeout_s=30.0)
    up = Updater(None, BundleStore(tmp / "store"), cfg, tmp / "state", lambda: None,  # type: ignore[arg-type]
                 lambda doc: None)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            Downloader(up)._download(url, tmp / "b", threading.Event())
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            errors.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    t.join(deadline_s + 30)
    took = time.monotonic() - t0
    for s in stop_after:  # ends the trickle, so a blocked download fails and the thread ends
        s.close()
    t.join(30)
    return took, errors
