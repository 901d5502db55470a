"""A URL whose first hop is slow (1.2 s before its 302) and whose redirect target trickles headers: the
one deadline spans every hop, so the download is cut at `download_deadline_s` in total, not per hop."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from agent.config import UpdatesConfig
from agent.updates.delivery import Downloader
from agent.updates.store import BundleStore
from agent.updates.updater import Updater
from test_updates_delivery_edges import HeaderTrickle

DEADLINE_S = 2.0


def _slow_redirect(target: str) -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            try:
                conn.recv(4096)
                time.sleep(1.2)
                conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n".encode())
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_the_deadline_spans_a_slow_hop_and_a_trickling_redirect_target(tmp_path: Path) -> None:
    trickle = HeaderTrickle()
    srv, port = _slow_redirect(f"http://127.0.0.1:{trickle.port}/b.tar.gz")
    up = Updater(None, BundleStore(tmp_path / "store"), UpdatesConfig(download_deadline_s=DEADLINE_S,  # type: ignore[arg-type]
                 download_timeout_s=30.0), tmp_path / "state", lambda: None, lambda doc: None)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            Downloader(up)._download(f"http://127.0.0.1:{port}/b.tar.gz", tmp_path / "b", threading.Event())
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            errors.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    t.join(DEADLINE_S + 30)
    took = time.monotonic() - t0
    trickle.close()
    srv.close()
    t.join(30)
    assert took < DEADLINE_S + 2, f"held {took:.1f} s over two hops (deadline {DEADLINE_S} s)"
    assert errors and isinstance(errors[0], TimeoutError) and "download_deadline_s" in str(errors[0]), errors
