"""Many sources in front of one pipeline: a capture thread per source, taken from in turn (no stream starves).

Each source keeps its own policy: a lossless one waits in a bounded queue (back-pressure on that source
only), a live one keeps only its latest frame (the stale one is counted against that source). A live
source's frame that waited in the pipeline's queue while a newer one arrived is swapped for the newer one
when the pipeline takes it (`freshest`), before anything converts it: the pipeline never converts a frame
that latest-frame-wins would drop, and each source keeps its turn. The pipeline
sees one lossless source whose frames carry their source's name; a stalled or reconnecting source delays
nobody else, and one stuck inside a read past its time-outs is reported as stuck in its own health while
the others serve: the multiplexer counts as alive while any of its sources is.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from agent.config import SourceConfig
from agent.logsetup import get_logger
from agent.serving.capabilities import ReportsStreams, SharesDecoderThreads, SkipsNonReference
from agent.serving.sources import CAPTURE_THREAD, BadFrame, Frame, FrameSource, SourceStats, is_lossless

log = get_logger("sources")

_ENDED = object()
STUCK_MARGIN_S = 1.0  # beyond a source's own time-outs: Python-side work between two heartbeats
SHUTDOWN_GRACE_S = 0.2  # how long close() still waits for a source already known stuck


def stuck_bound_s(cfg: SourceConfig) -> float:
    """How long a source's loop may go without a heartbeat while honouring its time-outs: a reopen may try
    twice (hardware decoding, then software), each up to the open time-out, then one read."""
    open_ms, read_ms = cfg.io_timeouts_ms()
    return (2 * open_ms + read_ms) / 1000 + STUCK_MARGIN_S


@dataclass
class Feed:
    """One source behind the multiplexer: its frames waiting to be taken, and what happened to them."""

    source: FrameSource
    lossless: bool
    capacity: int
    waiting: deque = field(default_factory=deque)
    ended: bool = False
    taken: int = 0        # frames handed to the pipeline
    newest_ns: int = 0    # live source: capture time of the newest frame handed to the pipeline (`freshest`)
    stale: int = 0        # live source: frames replaced by a newer one before the pipeline took them
    left_at_stop: int = 0  # frames read but still waiting when the agent stopped
    bound_s: float = 14.0  # quiet for longer than this (or the watchdog's horizon): stuck inside its read
    stuck_beat: float | None = None  # the heartbeat the source went quiet at, while stuck
    stuck_episodes: int = 0
    last_stuck_s: float | None = None  # how long the last finished episode lasted
    closed: bool = False
    source_type: str | None = None  # folder, stream, ...: for its health

    @property
    def name(self) -> str:
        return self.source.name


class MultiSource:
    """A FrameSource over several: `read` hands out the next waiting frame in round-robin order."""

    live = False  # the pipeline runs it lossless: each feed applies its own source's policy

    def __init__(self, sources: list[tuple[SourceConfig, FrameSource]], capacity: int = 2):
        if not sources:
            raise ValueError("MultiSource needs at least one source")
        self.feeds = [Feed(src, is_lossless(cfg, src), max(capacity, 1), bound_s=stuck_bound_s(cfg),
                           source_type=cfg.type)
                      for cfg, src in sources]
        # FFmpeg's decoder threads share the cores among the streams: each frame thread holds a decoding
        # context and its frames (about 25 MB at 1080p H.264), and one thread decodes a 1080p camera at 10-30
        # fps with room to spare. Sources opened lazily open with this; a configured decoder_threads is kept,
        # and the stage planner gives more to a decoder it measures as the bottleneck.
        share = max(1, len(os.sched_getaffinity(0)) // len(sources))
        for _, src in sources:
            if isinstance(src, SharesDecoderThreads) and src.open_threads == 0:
                src.open_threads = share
        self.name = "+".join(f.name for f in self.feeds)
        self._by_name = {f.name: f for f in self.feeds}
        self.on_drop: Callable[[str, int], None] | None = None  # the pipeline's drop counter
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._next = 0
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._own = SourceStats()
        self._horizon_s: float | None = None  # the watchdog's horizon, once the owner asked (see `stuck`)
        self._next_check = 0.0

    # -- the capture thread of each source ------------------------------------------------------------
    def _start(self) -> None:
        for feed in self.feeds:
            t = threading.Thread(target=self._capture, args=(feed,), name=f"{CAPTURE_THREAD}:{feed.name}", daemon=True)
            self._threads.append(t)
            t.start()

    def _capture(self, feed: Feed) -> None:
        # a live source whose last frame still waits: the next one replaces it, so a frame nothing references
        # (a B-frame) is not decoded at all (the codec decides; reference frames always are)
        skip = None if feed.lossless or not isinstance(feed.source, SkipsNonReference) else feed.source.skip_nonref
        try:
            while not self._stop.is_set():
                if skip is not None:
                    skip(bool(feed.waiting))
                t_cpu = time.thread_time_ns()
                try:
                    item: Any = feed.source.read(self._stop)
                    if isinstance(item, Frame):
                        feed.source.stats.cpu_ns += time.thread_time_ns() - t_cpu
                        feed.source.stats.cpu_frames += 1
                except BadFrame as exc:
                    item = exc  # handed on, so the pipeline counts it as it does for one source
                except Exception as exc:  # one source's bug ends that source, never the others
                    log.exception("source.crashed", source=feed.name)
                    feed.source.stats.state, feed.source.stats.last_error = "ended", f"{type(exc).__name__}: {exc}"
                    item = None
                feed.source.stats.beat()  # the read came back: a stuck episode is over
                if item is None:
                    break
                self._offer(feed, item)
        finally:
            with self._cond:
                feed.ended = True
                self._cond.notify_all()
                close_now = self._stop.is_set() and self._closing and not feed.closed
                feed.closed = feed.closed or close_now
            if close_now:  # close() gave up waiting for this read: the source is released on its way out
                feed.source.close()

    def _offer(self, feed: Feed, item: Any) -> None:
        stale: list[Frame] = []
        with self._cond:
            if feed.lossless:
                while len(feed.waiting) >= feed.capacity and not self._stop.is_set():
                    feed.source.stats.beat()  # waiting for the pipeline is not a hang
                    self._cond.wait(0.1)
                if self._stop.is_set():
                    feed.left_at_stop += 1
                    return
            elif len(feed.waiting) >= 1:  # latest frame wins, per source
                stale = [x for x in feed.waiting if isinstance(x, Frame)]
                dropped = len(stale)
                feed.waiting.clear()
                feed.stale += dropped
                if dropped and self.on_drop is not None:
                    self.on_drop("stale", dropped)
            feed.waiting.append(item)
            self._cond.notify_all()
        for f in stale:  # outside the lock: a sensor window tells its source's stream it was dropped
            f.settled(dropped=True)

    # -- the pipeline's side ----------------------------------------------------------------------------
    def read(self, stop: threading.Event) -> Frame | None:
        """The next waiting frame, taking each source in turn; None once every source has ended or `stop` is set."""
        if not self._threads:
            self._start()
        with self._cond:
            while not stop.is_set():
                self._own.beat()
                self._check_stuck()
                n = len(self.feeds)
                for k in range(n):
                    feed = self.feeds[(self._next + k) % n]
                    if feed.waiting:
                        item = feed.waiting.popleft()
                        self._next = (self._next + k + 1) % n
                        self._cond.notify_all()  # room for a lossless source waiting to put
                        if isinstance(item, BadFrame):
                            raise item
                        feed.taken += 1
                        feed.newest_ns = max(feed.newest_ns, item.captured_ns)
                        if item.source != feed.name:  # a folder names its frames per file: keep that as the item
                            item.item, item.source = item.source, feed.name
                        return item
                if all(f.ended for f in self.feeds):
                    self._own.state = "ended"
                    return None
                self._cond.wait(0.1)
        return None

    def freshest(self, frame: Frame) -> Frame | None:
        """At the pipeline's take, just before preprocessing converts `frame`, for a live source: the newer frame
        waiting in the source in its place, or None when a newer frame of that source is in the pipeline already
        (`frame` is to be skipped); either way `frame` counts as stale against the source and is released
        unconverted. A lossless source's frame, or a live one still the newest, is returned as it is. A swap
        keeps the source's turn: fairness as before."""
        feed = self._by_name.get(frame.source)
        if feed is None or feed.lossless:
            return frame
        with self._cond:
            newer = feed.waiting[-1] if feed.waiting and isinstance(feed.waiting[-1], Frame) else None
            if newer is not None:
                feed.waiting.pop()
                self._cond.notify_all()
                if newer.source != feed.name:
                    newer.item, newer.source = newer.source, feed.name
                feed.newest_ns = max(feed.newest_ns, newer.captured_ns)
                out: Frame | None = newer  # it takes `frame`'s place in `taken`
            else:
                out = frame if frame.captured_ns >= feed.newest_ns else None
                if out is None:
                    feed.taken -= 1
            if out is not frame:
                feed.stale += 1
        if out is not frame:
            frame.release()  # the pipeline counts the drop (it counted this frame as captured)
            frame.settled(dropped=True)
        return out

    # -- stuck sources -----------------------------------------------------------------------------------
    def _check_stuck(self, force: bool = False) -> None:
        """Start or end each source's stuck episode: quiet for longer than its time-outs allow (or the
        watchdog's horizon, the shorter), and over when its read comes back. Logged once per episode."""
        now = time.monotonic()
        with self._cond:
            if not force and now < self._next_check:
                return
            self._next_check = now + 0.2
            for f in self.feeds:
                s = f.source.stats
                if f.stuck_beat is not None:
                    if f.ended or s.heartbeat != f.stuck_beat:
                        f.last_stuck_s = round(max(s.heartbeat, f.stuck_beat) - f.stuck_beat, 3) if not f.ended \
                            else round(now - f.stuck_beat, 3)
                        f.stuck_beat = None
                        log.info("source.unstuck", source=f.name, stuck_s=f.last_stuck_s, ended=f.ended)
                    continue
                quiet = now - s.heartbeat
                if not f.ended and quiet > self._stuck_after(f):
                    f.stuck_beat = s.heartbeat
                    f.stuck_episodes += 1
                    s.last_error = f"stuck inside a read for more than {self._stuck_after(f):.1f} s"
                    alive = [g.name for g in self.feeds if g is not f and not g.ended and g.stuck_beat is None]
                    log.warning("source.stuck", source=f.name, quiet_s=round(quiet, 1),
                                stuck_after_s=round(self._stuck_after(f), 1), episodes=f.stuck_episodes,
                                still_serving=alive)

    def _stuck_after(self, f: Feed) -> float:
        return f.bound_s if self._horizon_s is None else min(f.bound_s, self._horizon_s)

    def stuck(self, horizon_s: float | None = None) -> dict[str, float]:
        """The running sources stuck inside a read, with the seconds since each was last alive. `horizon_s`
        (the watchdog's) caps how long a source may be quiet from now on, whatever its own time-outs."""
        if horizon_s is not None:
            self._horizon_s = horizon_s
        self._check_stuck(force=True)
        now = time.monotonic()
        with self._cond:
            return {f.name: round(now - f.stuck_beat, 1) for f in self.feeds if f.stuck_beat is not None}

    def state_key(self) -> tuple[str, ...]:
        """Each source's state, cheap: a change is worth publishing health at once."""
        self._check_stuck()
        return tuple(self._state(f) for f in self.feeds)

    @staticmethod
    def _state(f: Feed) -> str:
        return "stuck" if f.stuck_beat is not None else f.source.stats.state

    @property
    def stats(self) -> SourceStats:
        """All sources as one, for the pipeline's own checks: alive while any running source is (its newest
        heartbeat), so one source stuck inside a read does not stop the watchdog for all -- `stuck` and
        `per_source` name it; the newest frame of any."""
        self._check_stuck()
        st = [f.source.stats for f in self.feeds]
        running = [f for f in self.feeds if not f.ended]
        states = {self._state(f) for f in running}
        state = ("ended" if not running else "open" if "open" in states else "lost" if "lost" in states
                 else next(iter(sorted(states))))
        return SourceStats(state=state, frames=sum(s.frames for s in st), bad=sum(s.bad for s in st),
                           reconnects=sum(s.reconnects for s in st), losses=sum(s.losses for s in st),
                           frozen_events=sum(s.frozen_events for s in st),
                           last_frame_ns=max(s.last_frame_ns for s in st),
                           heartbeat=max([f.source.stats.heartbeat for f in running] or [self._own.heartbeat]))

    def capture_cpu_ms(self) -> float:
        """CPU per frame of the costliest source's capture thread: each source has one, so the slowest bounds."""
        per = [f.source.stats.cpu_ns / 1e6 / f.source.stats.cpu_frames for f in self.feeds if f.source.stats.cpu_frames]
        return max(per, default=0.0)

    def per_source(self) -> dict[str, dict[str, Any]]:
        """Each source's own health: state, counters, frame age, decoder, and what the multiplexer did."""
        self._check_stuck(force=True)
        now = time.perf_counter_ns()
        mono = time.monotonic()
        out = {}
        for f in self.feeds:
            s = f.source.stats
            beat = f.stuck_beat
            out[f.name] = {
                "type": f.source_type, "state": self._state(f),
                "stuck_s": None if beat is None else round(mono - beat, 1),  # inside one read, this long
                "stuck_episodes": f.stuck_episodes, "last_stuck_s": f.last_stuck_s,
                "stuck_after_s": round(self._stuck_after(f), 1),
                "lossless": f.lossless, "frames": s.frames, "served": f.taken, "stale": f.stale,
                "waiting": len(f.waiting), "left_at_stop": f.left_at_stop, "bad": s.bad,
                "reconnects": s.reconnects, "losses": s.losses, "frozen_events": s.frozen_events,
                "last_frame_age_s": round((now - s.last_frame_ns) / 1e9, 3) if s.last_frame_ns else None,
                "last_error": s.last_error, "decoder": dict(s.decoder),
            }
            if isinstance(f.source, ReportsStreams):  # a sensor source: its streams, losses, backlog (as one source)
                out[f.name]["streams"] = f.source.streams_health()
        return out

    def close(self) -> None:
        """Stop every capture thread and release its source. One shared 10 s wait for reads honouring their
        time-outs, a short grace for a source already stuck; a source still inside its read is released by
        its own thread when the read comes back (closing a VideoCapture under a read crashes or hangs it)."""
        self._check_stuck(force=True)  # a source past its time-outs now gets only the grace
        self._stop.set()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + 10
        for f, t in zip(self.feeds, self._threads):
            wait = max(0.0, deadline - time.monotonic())
            t.join(timeout=min(wait, SHUTDOWN_GRACE_S) if f.stuck_beat is not None else wait)
        for f in self.feeds:
            with self._cond:
                f.left_at_stop += sum(isinstance(x, Frame) for x in f.waiting)
                f.waiting.clear()
                still_reading = bool(self._threads) and not f.ended
                close_now = not still_reading and not f.closed
                f.closed = f.closed or close_now
            if still_reading:
                log.warning("source.close_while_reading", source=f.name, stuck=f.stuck_beat is not None)
                continue
            if close_now:
                f.source.close()
