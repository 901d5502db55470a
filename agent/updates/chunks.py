"""MQTT push: an offer, chunks in any order (resent on request), `done`; reassembled into a staging file and
handed to the updater on a job thread. Bounds: docs/updates.md "Hostile inputs"."""

from __future__ import annotations

import collections
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config import PayloadError, parse_json_object
from agent.logsetup import get_logger
from agent.updates.intake import RateLimitedWarnings, space_refusal, spawn_job
from agent.updates.machine import State
from agent.updates.updater import Updater

log = get_logger("delivery")

# JSON messages on the transfer protocol (offer, done) are small; chunks are bounded by max_chunk_bytes.
MAX_CONTROL_BYTES = 16 * 1024
# The sweeper removes only transfer staging: a download removes its own in `finally`, and whatever a
# crash leaves is cleared by the store's recover() at boot.
SWEPT_PREFIX = "push-"


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

    origin = "mqtt"
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
        spawn_job(f"update-{tid}", lambda: self._install(t))

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

    def run(self, stop: threading.Event) -> None:
        """Its loop (agent.updates.intake.Delivery): the sweeper."""
        period = max(0.2, min(self.cfg.transfer_idle_s / 4, 30.0))
        while not stop.wait(period):
            try:
                self.sweep()
            except OSError as exc:
                log.warning("staging.sweep_failed", error=str(exc))

    run_sweeper = run  # the controller's name for it until its wiring calls start_deliveries
