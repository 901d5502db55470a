"""A server that trickles its TLS handshake (a byte every 0.3 s, each well within the per-read timeout)
is still cut at `download_deadline_s`. The deadline guard watches the socket only once connect() (TCP and
TLS) has returned; what bounds the handshake is that CPython applies the socket timeout to the whole
handshake, and the connect timeout is capped by what is left of the deadline. This pins that."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from agent.config import UpdatesConfig
from agent.updates.delivery import Downloader
from agent.updates.store import BundleStore
from agent.updates.updater import Updater

DEADLINE_S = 2.0


class HandshakeTrickle:
    """Reads the ClientHello, then sends a TLS record header announcing 16 KiB and one byte every 0.3 s."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(b"\x16\x03\x03\x40\x00")  # handshake record, 16384 bytes to come
            for _ in range(2000):
                if self.stop.is_set():
                    break
                conn.sendall(b"\x00")
                time.sleep(0.3)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.srv.close()


def test_a_trickled_tls_handshake_is_cut_at_the_download_deadline(tmp_path: Path) -> None:
    server = HandshakeTrickle()
    cfg = UpdatesConfig(download_deadline_s=DEADLINE_S, download_timeout_s=30.0)
    up = Updater(None, BundleStore(tmp_path / "store"), cfg, tmp_path / "state", lambda: None,  # type: ignore[arg-type]
                 lambda doc: None)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            Downloader(up)._download(f"https://127.0.0.1:{server.port}/b.tar.gz", tmp_path / "b", threading.Event())
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            errors.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    t.join(DEADLINE_S + 30)
    took = time.monotonic() - t0
    server.close()  # ends the trickle, so a blocked handshake fails and the thread ends
    t.join(30)
    assert took < DEADLINE_S + 2, f"a trickled TLS handshake held the download {took:.1f} s (deadline {DEADLINE_S} s)"
    assert errors and isinstance(errors[0], TimeoutError), errors
    assert "download_deadline_s" in str(errors[0])
