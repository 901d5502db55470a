"""How bundles reach the updater: MQTT chunks (`ChunkReceiver`), a URL with its sha256 (`Downloader`),
or a `.tar.gz` dropped into an inbox (`watch_inbox`). Every input here is bounded before it costs anything.

Bounds and policy (each a config key under `updates`, see docs/updates.md "Hostile inputs"):
- an offer is refused unless size <= max_bundle_bytes, fits the free disk, and its chunk size lies in
  [min_chunk_bytes, max_chunk_bytes]; received chunks are one byte each in a bitmap, data goes to a file;
- one transfer at a time, newest wins: a new offer (or the same id offered again) ends the unfinished
  one and removes its file; an offer while a completed transfer installs is refused;
- a transfer idle for transfer_idle_s expires; a sweeper removes it and any orphaned transfer staging;
- one download at a time, one total deadline, size checked while streaming, https (http to loopback, or
  anywhere with allow_http), redirects only to allowed schemes, staging removed on every failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config import PayloadError, parse_json_object
from agent.errors import UrlRefused
from agent.logsetup import get_logger
from agent.updates.updater import Updater

log = get_logger("delivery")

# JSON messages on the transfer protocol (offer, done) are small; chunks are bounded by max_chunk_bytes.
MAX_CONTROL_BYTES = 16 * 1024
# The sweeper removes only transfer staging: a download removes its own in `finally`, and whatever a
# crash leaves is cleared by the store's recover() at boot.
SWEPT_PREFIX = "push-"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass
class Transfer:
    id: str
    size: int
    sha256: str
    chunk_size: int
    chunks: int
    path: Path
    received: bytearray = field(default_factory=bytearray)  # one byte per chunk: bounded by max chunks
    count: int = 0
    done_requests: int = 0
    last_activity: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.received:
            self.received = bytearray(self.chunks)

    def missing(self, limit: int) -> list[int]:
        out: list[int] = []
        i = self.received.find(0)
        while i != -1 and len(out) < limit:
            out.append(i)
            i = self.received.find(0, i + 1)
        return out


class ChunkReceiver:
    """Reassembles an MQTT-pushed bundle: offer, chunks (any order, resent on request), done."""

    MAX_DONE_WITHOUT_DATA = 3
    MAX_MISSING_LISTED = 1000

    def __init__(self, updater: Updater):
        self.updater = updater
        self.cfg = updater.cfg
        self.staging = updater.store.staging
        self.transfer: Transfer | None = None  # newest wins: at most one unfinished transfer
        self.installing: Transfer | None = None
        self.lock = threading.Lock()

    # -- the protocol, straight from MQTT (paho's network thread: cheap and bounded) ---------------------
    def on_message(self, suffix: str, payload: bytes) -> None:
        """`suffix` is the topic after the device prefix: bundle/offer, bundle/done, bundle/chunk/<id>/<i>."""
        if suffix.startswith("bundle/chunk/"):
            parts = suffix[len("bundle/chunk/"):].split("/")
            if len(parts) != 2 or not parts[1].isdigit() or len(parts[1]) > 9:
                log.warning("bundle.chunk_topic_malformed", topic=suffix[:120])
                return
            self.on_chunk(parts[0], int(parts[1]), payload)
            return
        if suffix not in ("bundle/offer", "bundle/done"):
            return  # update/status and replies are ours; anything else under bundle/ is ignored
        doc = self._control(suffix, payload)
        if doc is None:
            return
        (self.on_offer if suffix == "bundle/offer" else self.on_done)(doc)

    def _control(self, suffix: str, payload: bytes) -> dict[str, Any] | None:
        try:
            return parse_json_object(payload, MAX_CONTROL_BYTES)
        except PayloadError as exc:
            self.updater.status("?", "mqtt", "rejected", reason=f"malformed {suffix}: {exc}")
            return None

    def on_offer(self, doc: dict[str, Any]) -> None:
        cfg = self.cfg
        try:
            tid = str(doc["transfer"])
            size, sha, chunk = int(doc["size"]), str(doc["sha256"]), int(doc["chunk_size"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            self.updater.status(str(doc.get("transfer", "?"))[:64], "mqtt", "rejected", reason=f"malformed offer: {exc}")
            return
        reason = None
        if not tid or len(tid) > 64 or not all(c.isalnum() or c in "-_." for c in tid):
            tid, reason = tid[:64], "malformed offer: transfer id must be 1-64 letters, digits, '-', '_' or '.'"
        elif size <= 0:
            reason = f"malformed offer: size {size} is not positive"
        elif size > cfg.max_bundle_bytes:
            reason = f"offer of {size} bytes is over updates.max_bundle_bytes {cfg.max_bundle_bytes}"
        elif not cfg.min_chunk_bytes <= chunk <= cfg.max_chunk_bytes:
            reason = (f"offer chunk_size {chunk} is outside [{cfg.min_chunk_bytes}, {cfg.max_chunk_bytes}] "
                      "(updates.min_chunk_bytes, updates.max_chunk_bytes)")
        elif len(sha) != 64:
            reason = "malformed offer: sha256 must be 64 hex digits"
        else:
            free = free_bytes(self.staging)
            # the archive, and its unpacked copy, must fit with room to spare for the store
            if 2 * size + cfg.min_free_bytes > free:
                reason = (f"offer of {size} bytes does not fit: {free} bytes free under {self.staging} "
                          f"(needs 2x the archive plus updates.min_free_bytes {cfg.min_free_bytes})")
        if reason is not None:
            self.updater.status(tid, "mqtt", "rejected", reason=reason)
            return
        with self.lock:
            if self.installing is not None:
                busy = self.installing.id
            else:
                busy = None
                old, self.transfer = self.transfer, None
        if busy is not None:
            self.updater.status(tid, "mqtt", "rejected", reason=f"busy: transfer {busy} is being installed; offer again after its verdict")
            return
        if old is not None:
            self._drop(old)
            if old.id != tid:
                self.updater.status(old.id, "mqtt", "rejected", reason=f"superseded by transfer {tid} (newest offer wins)")
        path = self.updater.store.new_staging("push-") / "bundle.tar.gz"
        path.touch()
        t = Transfer(tid, size, sha, chunk, (size + chunk - 1) // chunk, path)
        with self.lock:
            self.transfer = t
        self.updater.status(tid, "mqtt", "receiving", name=str(doc.get("name"))[:100], version=doc.get("version")
                            if isinstance(doc.get("version"), (int, str)) else None, size=size)

    def on_chunk(self, tid: str, index: int, data: bytes) -> None:
        with self.lock:
            t = self.transfer
        if t is None or t.id != tid or not 0 <= index < t.chunks:
            return
        offset = index * t.chunk_size
        expected = min(t.chunk_size, t.size - offset)
        if len(data) != expected:
            log.warning("bundle.chunk_wrong_size", transfer=tid, index=index, size=len(data), expected=expected)
            return
        try:
            with open(t.path, "r+b") as f:
                f.seek(offset)
                f.write(data)
        except OSError as exc:  # dropped under us (superseded, expired) or the disk filled
            log.warning("bundle.chunk_not_written", transfer=tid, index=index, error=str(exc))
            return
        t.last_activity = time.monotonic()
        if t.received[index]:
            return
        before = t.count * 10 // t.chunks
        t.received[index] = 1
        t.count += 1
        if t.count * 10 // t.chunks > before:
            self.updater.status(tid, "mqtt", "progress", received=t.count, chunks=t.chunks)

    def on_done(self, doc: dict[str, Any]) -> None:
        tid = str(doc.get("transfer"))[:64]
        with self.lock:
            t = self.transfer if self.transfer is not None and self.transfer.id == tid else None
        if t is None:
            self.updater.status(tid, "mqtt", "rejected", reason="done for an unknown transfer (send the offer first)")
            return
        t.last_activity = time.monotonic()
        if t.count < t.chunks:
            t.done_requests += 1
            if t.done_requests >= self.MAX_DONE_WITHOUT_DATA:
                self._forget(t)
                self.updater.status(tid, "mqtt", "rejected",
                                    reason=f"truncated upload: {t.count} of {t.chunks} chunks arrived")
                return
            self.updater.status(tid, "mqtt", "missing", chunks=t.missing(self.MAX_MISSING_LISTED),
                                count=t.chunks - t.count)
            return
        with self.lock:
            if self.transfer is not t:
                return
            self.transfer, self.installing = None, t
        threading.Thread(target=self._install, args=(t,), name=f"update-{tid}", daemon=True).start()

    def _install(self, t: Transfer) -> None:
        try:
            self.updater.install(t.path, "mqtt", t.id, expected_sha256=t.sha256)
        finally:
            self._drop(t)
            with self.lock:
                self.installing = None

    def _forget(self, t: Transfer) -> None:
        with self.lock:
            if self.transfer is t:
                self.transfer = None
        self._drop(t)

    @staticmethod
    def _drop(t: Transfer) -> None:
        shutil.rmtree(t.path.parent, ignore_errors=True)

    # -- expiry -----------------------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> list[str]:
        """Expire an idle transfer and remove orphaned staging (a crash, a killed download). Returns what went."""
        now = time.monotonic() if now is None else now
        idle = self.cfg.transfer_idle_s
        gone: list[str] = []
        with self.lock:
            t = self.transfer
            if t is not None and now - t.last_activity > idle:
                self.transfer = None
            else:
                t = None
            live = {p.path.parent for p in (self.transfer, self.installing) if p is not None}
        if t is not None:
            self._drop(t)
            gone.append(t.id)
            self.updater.status(t.id, "mqtt", "rejected",
                                reason=f"expired: no message for {idle:g} s (updates.transfer_idle_s); "
                                       f"{t.count} of {t.chunks} chunks had arrived")
        wall = time.time()
        for p in list(self.staging.iterdir()) if self.staging.is_dir() else []:
            if not p.name.startswith(SWEPT_PREFIX) or p in live:
                continue
            try:
                age = wall - p.stat().st_mtime
            except OSError:
                continue
            newest = max((q.stat().st_mtime for q in p.iterdir()), default=wall - age) if p.is_dir() else 0
            if age > idle and wall - newest > idle:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p.name)
        if gone:
            log.info("staging.swept", removed=gone)
        return gone

    def run_sweeper(self, stop: threading.Event) -> None:
        period = max(0.2, min(self.cfg.transfer_idle_s / 4, 30.0))
        while not stop.wait(period):
            try:
                self.sweep()
            except OSError as exc:
                log.warning("staging.sweep_failed", error=str(exc))


# -- URL ------------------------------------------------------------------------------------------------
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


class _RedirectChecker(urllib.request.HTTPRedirectHandler):
    max_redirections = 5

    def __init__(self, allow_http: bool):
        self.allow_http = allow_http

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        try:
            check_url(urllib.parse.urljoin(req.full_url, newurl), self.allow_http)
        except UrlRefused as exc:
            raise urllib.error.URLError(f"redirect refused: {exc}") from exc
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class Downloader:
    """URL delivery: one download at a time, one total deadline, bounded size, staging always removed."""

    def __init__(self, updater: Updater):
        self.updater = updater
        self.cfg = updater.cfg
        self.busy = threading.Lock()

    def fetch(self, url: str, sha256: str, update: str) -> dict[str, Any]:
        update = update[:100]
        try:
            check_url(url, self.cfg.allow_http)
        except UrlRefused as exc:
            return self.updater.status(update, "url", "rejected", reason=str(exc))
        if not self.busy.acquire(blocking=False):
            return self.updater.status(update, "url", "rejected",
                                       reason="busy: a download is already running; send it again after its verdict")
        try:
            work = self.updater.store.new_staging("download-")
            try:
                self.updater.status(update, "url", "downloading", url=url)
                dest = work / "bundle.tar.gz"
                try:
                    self._download(url, dest)
                except (OSError, ValueError, urllib.error.URLError, TimeoutError) as exc:
                    return self.updater.status(update, "url", "rejected", reason=f"download failed: {exc}")
                return self.updater.install(dest, "url", update, expected_sha256=sha256)
            except Exception as exc:  # never leave "downloading" as the last word
                log.exception("download.failed", update=update)
                return self.updater.status(update, "url", "rejected", reason=f"download failed: {type(exc).__name__}: {exc}")
            finally:
                shutil.rmtree(work, ignore_errors=True)
        finally:
            self.busy.release()

    def _download(self, url: str, dest: Path) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.download_deadline_s
        opener = urllib.request.build_opener(_RedirectChecker(cfg.allow_http))
        per_read = min(cfg.download_timeout_s, cfg.download_deadline_s)
        with opener.open(url, timeout=per_read) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cfg.max_bundle_bytes:
                raise ValueError(f"Content-Length {length} is over updates.max_bundle_bytes {cfg.max_bundle_bytes}")
            sock = _socket_of(r)
            total = 0
            with open(dest, "wb") as f:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"not complete within updates.download_deadline_s {cfg.download_deadline_s:g} s "
                                           f"({total} bytes arrived)")
                    if sock is not None:
                        sock.settimeout(min(per_read, remaining))
                    try:
                        chunk = r.read1(1 << 16)
                    except TimeoutError as exc:
                        if time.monotonic() >= deadline - 0.05:
                            raise TimeoutError(f"not complete within updates.download_deadline_s "
                                               f"{cfg.download_deadline_s:g} s ({total} bytes arrived)") from exc
                        raise TimeoutError(f"no data for updates.download_timeout_s {cfg.download_timeout_s:g} s "
                                           f"({total} bytes arrived)") from exc
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > cfg.max_bundle_bytes:
                        raise ValueError(f"download over updates.max_bundle_bytes {cfg.max_bundle_bytes}")
                    f.write(chunk)


def _socket_of(response: Any) -> socket.socket | None:
    raw = getattr(getattr(response, "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


# -- inbox ----------------------------------------------------------------------------------------------
def watch_inbox(updater: Updater, stop: threading.Event) -> None:
    inbox = updater.cfg.inbox
    if inbox is None:
        return
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True, exist_ok=True)
    while not stop.wait(1.0):
        for f in sorted(inbox.glob("*.tar.gz")):  # copy as .part, then rename: only whole files match
            result = updater.install(f, "inbox", f.name)
            target = inbox / ("done" if result["state"] == "committed" else "rejected") / f.name
            os.replace(f, target)
            if result["state"] != "committed":
                target.with_suffix(".reason.txt").write_text(str(result.get("reason")) + "\n")
