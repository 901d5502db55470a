"""A URL whose first hop is slow (1.2 s before its 302) and whose redirect target trickles headers: the
one deadline spans every hop, so the download is cut at `download_deadline_s` in total, not per hop."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from slow_servers import header_trickle, tcp_server, timed_download

DEADLINE_S = 2.0


def _slow_redirect(target: str) -> tuple[socket.socket, int]:
    def redirect(conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            time.sleep(1.2)
            conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n".encode())
        except OSError:
            pass
        finally:
            conn.close()

    srv = tcp_server(redirect)
    return srv, srv.getsockname()[1]


def test_the_deadline_spans_a_slow_hop_and_a_trickling_redirect_target(tmp_path: Path) -> None:
    trickle = header_trickle()
    srv, port = _slow_redirect(f"http://127.0.0.1:{trickle.port}/b.tar.gz")
    took, errors = timed_download(tmp_path, f"http://127.0.0.1:{port}/b.tar.gz", DEADLINE_S, trickle, srv)
    assert took < DEADLINE_S + 2, f"held {took:.1f} s over two hops (deadline {DEADLINE_S} s)"
    assert errors and isinstance(errors[0], TimeoutError) and "download_deadline_s" in str(errors[0]), errors
