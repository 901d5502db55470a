"""A server that trickles its TLS handshake (a byte every 0.3 s, each well within the per-read timeout)
is still cut at `download_deadline_s`. The deadline guard watches the socket only once connect() (TCP and
TLS) has returned; what bounds the handshake is that CPython applies the socket timeout to the whole
handshake, and the connect timeout is capped by what is left of the deadline. This pins that."""

from __future__ import annotations

from pathlib import Path

from slow_servers import handshake_trickle, timed_download

DEADLINE_S = 2.0


def test_a_trickled_tls_handshake_is_cut_at_the_download_deadline(tmp_path: Path) -> None:
    server = handshake_trickle()
    took, errors = timed_download(tmp_path, f"https://127.0.0.1:{server.port}/b.tar.gz", DEADLINE_S, server)
    assert took < DEADLINE_S + 2, f"a trickled TLS handshake held the download {took:.1f} s (deadline {DEADLINE_S} s)"
    assert errors and isinstance(errors[0], TimeoutError), errors
    assert "download_deadline_s" in str(errors[0])
