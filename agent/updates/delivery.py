"""How bundles reach the updater: MQTT chunks (`ChunkReceiver`), a URL with its sha256 (`Downloader`),
or a `.tar.gz` dropped into an inbox (`watch_inbox`). Every input here is bounded before it costs anything.

Bounds and policy (each a config key under `updates`, see docs/updates.md "Hostile inputs"):
- an offer is refused unless size <= max_bundle_bytes, fits the free disk, and its chunk size lies in
  [min_chunk_bytes, max_chunk_bytes]; received chunks are one byte each in a bitmap, data goes to a file;
- one update at a time is the update machine's state (agent.updates.machine, docs/updates.md), not a lock
  here: a new offer (or the same id offered again) supersedes a receiving delivery; an offer, download or
  inbox file while an update verifies, proves, switches or is on probation is refused "busy";
- a transfer idle for transfer_idle_s expires; a sweeper removes it and any orphaned transfer staging;
- a download has one total deadline (connect, status line, headers, body), size checked while streaming,
  https (http to loopback, or anywhere with allow_http), redirects only to allowed schemes, staging removed
  on every failure; a rollback or a newer offer cancels it;
- an inbox entry that is not a regular file is refused by lstat before any open; any exception in any path
  is a `rejected` verdict and the path keeps going.
"""

from __future__ import annotations

import collections
import http.client
import os
import shutil
import socket
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3

from agent.config import PayloadError, parse_json_object
from agent.errors import AgentError, UpdateRejected, UrlRefused
from agent.logsetup import get_logger
from agent.updates.machine import State
from agent.updates.updater import Updater, file_kind

log = get_logger("delivery")

# JSON messages on the transfer protocol (offer, done) are small; chunks are bounded by max_chunk_bytes.
MAX_CONTROL_BYTES = 16 * 1024
# The sweeper removes only transfer staging: a download removes its own in `finally`, and whatever a
# crash leaves is cleared by the store's recover() at boot.
SWEPT_PREFIX = "push-"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_refusal(what: str, size: int, where: Path, min_free: int, copies: int = 2) -> str | None:
    """Why a bundle of `size` bytes cannot be taken under `where`, or None: the archive and its unpacked copy
    (`copies` of its size: 1 when the archive already lies on that disk) must fit with updates.min_free_bytes
    to spare. Every delivery path asks before its first byte is written (an offer, a URL's Content-Length,
    an inbox file): the URL and inbox paths used to write until the disk was full."""
    free = free_bytes(where)
    if copies * size + min_free <= free:
        return None
    return (f"{what} of {size} bytes does not fit: {free} bytes free under {where} "
            f"(needs {copies}x the archive plus updates.min_free_bytes {min_free})")


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
    REFUSALS_KEPT = 16

    def __init__(self, updater: Updater):
        self.updater = updater
        self.cfg = updater.cfg
        self.staging = updater.store.staging
        self.transfer: Transfer | None = None  # newest wins: at most one unfinished transfer
        self.installing: Transfer | None = None  # only so the sweeper leaves its staging alone
        self.lock = threading.Lock()  # the transfer slots: the controller's thread vs the sweeper
        self.warnings = RateLimitedWarnings(log)  # 2,000 wrong-size chunks are a few lines with counts
        # the last offers refused, and why: the pusher's `done` that follows must not overwrite the retained
        # status's real reason with "done for an unknown transfer"
        self.refused: collections.OrderedDict[str, str] = collections.OrderedDict()

    # -- the protocol, straight from MQTT (paho's network thread: cheap and bounded) ---------------------
    def on_message(self, suffix: str, payload: bytes) -> None:
        """`suffix` is the topic after the device prefix: bundle/offer, bundle/done, bundle/chunk/<id>/<i>."""
        if suffix.startswith("bundle/chunk/"):
            parts = suffix[len("bundle/chunk/"):].split("/")
            if len(parts) != 2 or not parts[1].isdigit() or len(parts[1]) > 9:
                self.warnings.warn("bundle.chunk_topic_malformed", topic=suffix[:120])
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
        else:  # the archive, and its unpacked copy, must fit with room to spare for the store
            reason = space_refusal("offer", size, self.staging, cfg.min_free_bytes)
        if reason is not None:
            self._refuse_offer(tid, reason)
            return
        held = self.updater.machine.snapshot
        busy = self.updater.begin(tid, "mqtt", offer=True)  # the machine's state is the one guard
        if busy is not None:
            self._refuse_offer(tid, f"{busy} (update {held.update}); offer again after its verdict")
            return
        with self.lock:
            old, self.transfer = self.transfer, None
        if old is not None:
            self._drop(old)
            if old.id != tid:
                self.updater.status(old.id, "mqtt", "rejected", reason=f"superseded by transfer {tid} (newest offer wins)")
        try:
            path = self.updater.store.new_staging("push-") / "bundle.tar.gz"
            path.touch()
        except OSError as exc:
            self.updater.refuse(tid, "mqtt", f"cannot stage the transfer: {exc}")
            return
        t = Transfer(tid, size, sha, chunk, (size + chunk - 1) // chunk, path)
        with self.lock:
            self.transfer = t
        self.updater.status(tid, "mqtt", "receiving", name=str(doc.get("name"))[:100], version=doc.get("version")
                            if isinstance(doc.get("version"), (int, str)) else None, size=size)

    def _refuse_offer(self, tid: str, reason: str) -> None:
        with self.lock:
            self.refused[tid] = reason
            self.refused.move_to_end(tid)
            while len(self.refused) > self.REFUSALS_KEPT:
                self.refused.popitem(last=False)
        self.updater.status(tid, "mqtt", "rejected", reason=reason)

    def on_chunk(self, tid: str, index: int, data: bytes) -> None:
        with self.lock:
            t = self.transfer
        if t is None or t.id != tid or not 0 <= index < t.chunks:
            return
        if not self._holds(t):
            return
        offset = index * t.chunk_size
        expected = min(t.chunk_size, t.size - offset)
        if len(data) != expected:
            self.warnings.warn("bundle.chunk_wrong_size", transfer=tid, index=index, size=len(data), expected=expected)
            return
        try:
            with open(t.path, "r+b") as f:
                f.seek(offset)
                f.write(data)
        except OSError as exc:  # dropped under us (superseded, expired) or the disk filled
            self.warnings.warn("bundle.chunk_not_written", transfer=tid, index=index, error=str(exc))
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
            with self.lock:
                refused = self.refused.get(tid)
            # a refused offer's `done`: its refusal again (the retained status keeps the real reason)
            self.updater.status(tid, "mqtt", "rejected",
                                reason=refused or "done for an unknown transfer (send the offer first)")
            return
        if not self._holds(t):
            return
        t.last_activity = time.monotonic()
        if t.count < t.chunks:
            t.done_requests += 1
            if t.done_requests >= self.MAX_DONE_WITHOUT_DATA:
                self._forget(t)
                self.updater.refuse(tid, "mqtt", f"truncated upload: {t.count} of {t.chunks} chunks arrived")
                return
            self.updater.status(tid, "mqtt", "missing", chunks=t.missing(self.MAX_MISSING_LISTED),
                                count=t.chunks - t.count)
            return
        with self.lock:
            if self.transfer is not t:
                return
            self.transfer, self.installing = None, t
        # one install thread at most: the machine leaves Receiving here, so no other offer gets this far
        threading.Thread(target=self._install, args=(t,), name=f"update-{tid}", daemon=True).start()

    def _holds(self, t: Transfer) -> bool:
        """Whether the machine still receives this transfer; a rollback or a restart took it away otherwise."""
        snap = self.updater.machine.snapshot
        if snap.update == t.id and snap.state == State.RECEIVING:
            return True
        self._forget(t)
        return False

    def _install(self, t: Transfer) -> None:
        try:
            self.updater.install(t.path, "mqtt", t.id, expected_sha256=t.sha256)
        except Exception as exc:  # install turns errors into verdicts; this is the last net
            log.exception("update.install_failed", update=t.id)
            self.updater.refuse(t.id, "mqtt", f"{type(exc).__name__}: {exc}")
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
            self.updater.refuse(t.id, "mqtt", f"expired: no message for {idle:g} s (updates.transfer_idle_s); "
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


class Downloader:
    """URL delivery: one total deadline over connect, status line, headers and body; bounded size;
    cancelled by a rollback or a newer offer; staging always removed. One at a time is the machine's state."""

    MAX_REDIRECTS = 5

    def __init__(self, updater: Updater):
        self.updater = updater
        self.cfg = updater.cfg

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


class RateLimitedWarnings:
    """A warning repeated by a flood (2,000 wrong-size chunks) is logged once per interval per event, with
    the count of the ones left out."""

    def __init__(self, logger: Any, interval_s: float = 10.0):
        self.log, self.interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, event: str, **kw: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(event, -1e9) < self.interval_s:
            self._quiet[event] = self._quiet.get(event, 0) + 1
            return
        self._last[event] = now
        self.log.warning(event, suppressed=self._quiet.pop(event, 0), **kw)


# -- inbox ----------------------------------------------------------------------------------------------
def _file_away(inbox: Path, entry: Path, verdict: dict[str, Any]) -> None:
    committed = verdict.get("state") == "committed"
    target = inbox / ("done" if committed else "rejected") / entry.name
    try:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)  # moves the entry itself: a symlink, a FIFO or a directory as it is
    except OSError as exc:
        log.error("inbox.not_filed", entry=entry.name, error=str(exc),
                  fix="remove the entry by hand: the watcher skips it while it is there")
        raise
    if not committed:
        try:  # filed already: a reason the disk cannot take is logged (and published), never a stuck name
            target.with_name(target.name + ".reason.txt").write_text(str(verdict.get("reason")) + "\n")
        except OSError as exc:
            log.error("inbox.reason_not_written", entry=entry.name, error=str(exc), reason=verdict.get("reason"))


def _take_entry(entry: Path, work: Path, limit: int, min_free: int = 0) -> Path:
    """The entry under a name in `work`: a hard link (the same inode, no copy; a FIFO or a symlink linked
    here is still refused by the updater's lstat), or across file systems a copy through a descriptor
    opened without following a link and without blocking on a FIFO, bounded by `limit`. Either way its
    unpacked copy (and a copy of the archive) must fit first."""
    dest = work / "bundle.tar.gz"
    size = entry.lstat().st_size
    if size > limit:
        raise UpdateRejected(f"{entry.name}: {size} bytes is over updates.max_bundle_bytes {limit}")
    try:
        os.link(entry, dest, follow_symlinks=False)
    except OSError:
        pass  # another file system, or protected_hardlinks: copy
    else:
        if (why := space_refusal(entry.name, size, work, min_free, copies=1)) is not None:
            raise UpdateRejected(f"{why}; refused before unpacking")
        return dest
    if (why := space_refusal(entry.name, size, work, min_free)) is not None:
        raise UpdateRejected(f"{why}; refused before copying")
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UpdateRejected(f"{entry.name}: cannot be opened as a regular file ({exc}); refused") from exc
    with open(fd, "rb") as src:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UpdateRejected(f"{entry.name}: not a regular file ({file_kind(st.st_mode)}); refused before reading")
        copied = 0
        with open(dest, "xb") as out:
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > limit:
                    raise UpdateRejected(f"{entry.name}: over updates.max_bundle_bytes {limit}")
                out.write(chunk)
    return dest


def inbox_entry(updater: Updater, inbox: Path, entry: Path) -> dict[str, Any] | None:
    """One inbox entry to its verdict, filed under done/ or rejected/; None when the machine is busy (the
    entry stays for the next pass). An entry that is not a regular file is refused by lstat, never opened."""
    name = entry.name[:200]
    try:
        st = entry.lstat()
    except FileNotFoundError:
        return None  # gone between the listing and now
    if not stat.S_ISREG(st.st_mode):
        verdict = updater.status(name, "inbox", "rejected",
                                 reason=f"{name}: not a regular file ({file_kind(st.st_mode)}); refused before opening")
    else:
        busy = updater.begin(name, "inbox")
        if busy is not None:
            return None
        work: Path | None = None
        try:
            # the entry can be swapped (for a FIFO, a symlink) after this lstat: the updater reads it only
            # under a name in the agent's own staging, which nobody else can swap
            work = updater.store.new_staging("inbox-")
            taken = _take_entry(entry, work, updater.cfg.max_bundle_bytes, updater.cfg.min_free_bytes)
            verdict = updater.install(taken, "inbox", name)
        except AgentError as exc:
            verdict = updater.refuse(name, "inbox", str(exc))
        except Exception as exc:
            log.exception("inbox.entry_failed", entry=name)
            verdict = updater.refuse(name, "inbox", f"{type(exc).__name__}: {exc}")
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
    _file_away(inbox, entry, verdict)
    return verdict


def watch_inbox(updater: Updater, stop: threading.Event, period_s: float = 1.0) -> None:
    inbox = updater.cfg.inbox
    if inbox is None:
        return
    for sub in ("done", "rejected"):
        (inbox / sub).mkdir(parents=True, exist_ok=True)
    # entries that could not be moved away: skipped, not retried in a loop; by identity, not by name, so the
    # same name removed by hand and dropped again (a new file) is looked at
    unfiled: dict[str, tuple[int, ...]] = {}
    while not stop.wait(period_s):
        try:
            entries = sorted(inbox.glob("*.tar.gz"))  # copy as .part, then rename: only whole files match
        except OSError as exc:
            log.error("inbox.unreadable", inbox=str(inbox), error=str(exc))
            continue
        listed = {e.name for e in entries}
        unfiled = {k: v for k, v in unfiled.items() if k in listed}  # bounded by what is there now
        for entry in entries:
            if stop.is_set():
                break
            if entry.name in unfiled:
                if _identity(entry) == unfiled[entry.name]:
                    continue
                del unfiled[entry.name]
            seen = _identity(entry)  # before it is handled: the verdict goes out before a failed move, and the
            try:                     # name may hold a new file by the time the failure is caught
                inbox_entry(updater, inbox, entry)
            except Exception:  # one bad entry never ends the watcher
                log.exception("inbox.entry_failed", entry=entry.name[:200])
                unfiled[entry.name] = seen


def _identity(entry: Path) -> tuple[int, ...]:
    try:
        st = entry.lstat()
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns)
