"""URL delivery: the `update` command's URL, fetched under one total deadline with its size bounded while
streaming, cancelled by a rollback or a newer offer, then handed to the updater on the command's job thread."""

from __future__ import annotations

import http.client
import shutil
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import urllib3

from agent.errors import UrlRefused
from agent.logsetup import get_logger
from agent.updates.intake import free_bytes, space_refusal
from agent.updates.updater import Updater

log = get_logger("delivery")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def check_url(url: str, allow_http: bool) -> urllib.parse.SplitResult:
    """A URL we are willing to fetch: no control characters or spaces, a host, https (http when allowed)."""
    if len(url) > 2048:
        raise UrlRefused(f"URL is {len(url)} characters (at most 2048)")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UrlRefused("URL contains spaces or control characters (header injection is refused)")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise UrlRefused(f"malformed URL {url[:200]!r}: {exc}") from exc
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise UrlRefused(f"only https URLs are fetched (http with updates.allow_http), not {url[:200]!r}")
    if parts.scheme == "http" and not allow_http and parts.hostname not in LOOPBACK:
        raise UrlRefused(f"http to {parts.hostname} is refused: use https, or set updates.allow_http: true")
    if parts.username or parts.password:
        raise UrlRefused("URLs with credentials are refused")
    return parts


class Downloader:
    """URL delivery: one total deadline over connect, status line, headers and body; bounded size;
    cancelled by a rollback or a newer offer; staging always removed. One at a time is the machine's state."""

    origin = "url"
    MAX_REDIRECTS = 5

    def __init__(self, updater: Updater):
        self.updater = updater
        self.cfg = updater.cfg

    def run(self, stop: threading.Event) -> None:
        """No loop of its own (agent.updates.intake.Delivery): each download runs on its command's job thread."""

    def refusal(self, url: str, update: str) -> dict[str, Any] | None:
        """The verdict for a URL refused before anything is fetched, or None when it may be fetched."""
        try:
            check_url(url, self.cfg.allow_http)
        except UrlRefused as exc:
            return self.updater.status(update, "url", "rejected", reason=str(exc))
        return None

    def fetch(self, url: str, sha256: str, update: str) -> dict[str, Any]:
        """Check, take the machine, download, install. For the controller, `begin` + `fetch_started`."""
        update = update[:100]
        try:
            check_url(url, self.cfg.allow_http)
        except UrlRefused as exc:
            return self.updater.status(update, "url", "rejected", reason=str(exc))
        busy = self.updater.begin(update, "url")
        if busy is not None:
            return self.updater.status(update, "url", "rejected", reason=f"{busy}; send it again after its verdict")
        return self.fetch_started(url, sha256, update)

    def fetch_started(self, url: str, sha256: str, update: str,
                      cancel: threading.Event | None = None) -> dict[str, Any]:
        """The download once the machine took it; `cancel` is the event that machine start handed out
        (a newer offer or a rollback sets it)."""
        cancel = cancel if cancel is not None else self.updater.machine.cancel
        try:
            work = self.updater.store.new_staging("download-")
            try:
                self.updater.status(update, "url", "downloading", url=url)
                dest = work / "bundle.tar.gz"
                try:
                    self._download(url, dest, cancel)
                except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
                    return self.updater.refuse(update, "url", f"download failed: {exc}")
                return self.updater.install(dest, "url", update, expected_sha256=sha256)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        except Exception as exc:  # never leave "downloading" as the last word
            log.exception("download.failed", update=update)
            return self.updater.refuse(update, "url", f"download failed: {type(exc).__name__}: {exc}")

    def _download(self, url: str, dest: Path, cancel: threading.Event) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.download_deadline_s
        for _ in range(self.MAX_REDIRECTS + 1):
            parts = check_url(url, cfg.allow_http)
            with _Deadline(deadline, cancel, cfg.download_deadline_s) as guard:
                location = self._get(parts, dest, guard)
            if location is None:
                return
            try:
                url = urllib.parse.urljoin(url, location)
                check_url(url, cfg.allow_http)
            except UrlRefused as exc:
                raise ValueError(f"redirect refused: {exc}") from exc
        raise ValueError(f"more than {self.MAX_REDIRECTS} redirects")

    def _get(self, parts: urllib.parse.SplitResult, dest: Path, guard: "_Deadline") -> str | None:
        """One request; the redirect location, or None once the body is in `dest`."""
        cfg = self.cfg
        per_read = min(cfg.download_timeout_s, cfg.download_deadline_s)
        https = parts.scheme == "https"
        cls = urllib3.connection.HTTPSConnection if https else urllib3.connection.HTTPConnection
        kw: dict[str, Any] = {"cert_reqs": "CERT_REQUIRED"} if https else {}
        conn = cls(str(parts.hostname), parts.port or (443 if https else 80), timeout=guard.timeout(per_read), **kw)
        try:
            conn.connect()  # bounded by the connect timeout (at most what is left of the deadline)
            # the socket itself: http.client drops conn.sock once the response owns it (HTTP/1.0, close)
            guard.watch(conn.sock)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            # streamed, never preloaded (the body is bounded while it arrives); identity: no decompression bomb
            conn.request("GET", path, headers={"User-Agent": "edge-agent", "Accept-Encoding": "identity"},
                         preload_content=False, decode_content=False)
            guard.check()
            r = conn.getresponse()  # status line and headers: the guard shuts the socket at the deadline
            guard.check()
            if r.status in (301, 302, 303, 307, 308):
                location = r.headers.get("Location")
                if not location:
                    raise ValueError(f"HTTP {r.status} with no Location")
                return location
            if r.status != 200:
                raise ValueError(f"HTTP {r.status} {r.reason}")
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cfg.max_bundle_bytes:
                raise ValueError(f"Content-Length {length} is over updates.max_bundle_bytes {cfg.max_bundle_bytes}")
            if length is not None and length.isdigit() and (
                    why := space_refusal("download", int(length), dest.parent, cfg.min_free_bytes)) is not None:
                raise ValueError(why)  # before a byte is written
            total = 0
            with open(dest, "wb") as f:
                while True:
                    guard.check()
                    if guard.sock.fileno() != -1:  # closed by the response itself once the body is complete
                        guard.sock.settimeout(guard.timeout(per_read))
                    try:
                        chunk = r.read(1 << 16)
                    except (TimeoutError, urllib3.exceptions.ReadTimeoutError) as exc:
                        guard.check()
                        raise TimeoutError(f"no data for updates.download_timeout_s {cfg.download_timeout_s:g} s "
                                           f"({total} bytes arrived)") from exc
                    if not chunk:
                        guard.check()
                        break
                    total += len(chunk)
                    if total > cfg.max_bundle_bytes:
                        raise ValueError(f"download over updates.max_bundle_bytes {cfg.max_bundle_bytes}")
                    if length is None and total % (1 << 20) < len(chunk) and free_bytes(dest.parent) < \
                            2 * total + cfg.min_free_bytes:  # no length said: checked every MiB as it arrives
                        raise ValueError(space_refusal("download", total, dest.parent, cfg.min_free_bytes))
                    f.write(chunk)
            return None
        except (OSError, urllib3.exceptions.HTTPError, http.client.HTTPException) as exc:
            guard.check()  # the deadline or a cancel is the real reason for whatever the socket said
            if isinstance(exc, (TimeoutError, urllib3.exceptions.TimeoutError)):
                raise TimeoutError(f"no data for updates.download_timeout_s {cfg.download_timeout_s:g} s") from exc
            if isinstance(exc, http.client.HTTPException):
                raise ValueError(f"malformed HTTP response: {exc}") from exc
            raise
        finally:
            conn.close()


class _Deadline:
    """One total deadline over connect, status line, headers and body. A per-read timeout cannot bound a
    server that trickles a byte every second; this guard thread shuts the socket down at the deadline (or
    at a cancel), which wakes any read blocked on it."""

    def __init__(self, deadline: float, cancel: threading.Event, total_s: float):
        self.deadline, self.cancel, self.total_s = deadline, cancel, total_s
        self._done = threading.Event()
        self.sock: Any = None
        self.why: str | None = None

    def __enter__(self) -> "_Deadline":
        self.check()
        self._thread = threading.Thread(target=self._run, name="download-deadline", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def watch(self, sock: Any) -> None:
        self.sock = sock
        if self.why is not None:  # fired while connecting
            self._shutdown()

    def timeout(self, per_read: float) -> float:
        return max(0.05, min(per_read, self.deadline - time.monotonic()))

    def check(self) -> None:
        if self.cancel.is_set():
            raise ValueError("cancelled: a rollback or a newer offer took the update machine")
        if time.monotonic() >= self.deadline or self.why is not None:
            raise TimeoutError(f"not complete within updates.download_deadline_s {self.total_s:g} s")

    def _shutdown(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it, in any thread
            except OSError:
                pass

    def _run(self) -> None:
        while not self._done.is_set():
            if self.cancel.is_set() or time.monotonic() >= self.deadline:
                self.why = "cancelled" if self.cancel.is_set() else "deadline"
                self._shutdown()
                return
            self.cancel.wait(min(0.1, max(0.0, self.deadline - time.monotonic())))

