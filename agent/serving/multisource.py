"""Many sources in front of one pipeline: a capture thread per source, taken from in turn (no stream starves).

Each source keeps its own policy: a lossless one waits in a bounded queue (back-pressure on that source
only), a live one keeps only its latest frame (the stale one is counted against that source). The pipeline
sees one lossless source whose frames carry their source's name; a stalled or reconnecting source delays
nobody else.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from agent.config import SourceConfig
from agent.logsetup import get_logger
from agent.serving.sources import BadFrame, Frame, FrameSource, SourceStats, is_lossless

log = get_logger("sources")

_ENDED = object()


@dataclass
class Feed:
    """One source behind the multiplexer: its frames waiting to be taken, and what happened to them."""

    source: FrameSource
    lossless: bool
    capacity: int
    waiting: deque = field(default_factory=deque)
    ended: bool = False
    taken: int = 0        # frames handed to the pipeline
    stale: int = 0        # live source: frames replaced by a newer one before the pipeline took them
    left_at_stop: int = 0  # frames read but still waiting when the agent stopped

    @property
    def name(self) -> str:
        return self.source.name


class MultiSource:
    """A FrameSource over several: `read` hands out the next waiting frame in round-robin order."""

    live = False  # the pipeline runs it lossless: each feed applies its own source's policy

    def __init__(self, sources: list[tuple[SourceConfig, FrameSource]], capacity: int = 2):
        if not sources:
            raise ValueError("MultiSource needs at least one source")
        self.feeds = [Feed(src, is_lossless(cfg, src), max(capacity, 1)) for cfg, src in sources]
        self.name = "+".join(f.name for f in self.feeds)
        self.on_drop: Callable[[str, int], None] | None = None  # the pipeline's drop counter
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._next = 0
        self._threads: list[threading.Thread] = []
        self._own = SourceStats()

    # -- the capture thread of each source ------------------------------------------------------------
    def _start(self) -> None:
        for feed in self.feeds:
            t = threading.Thread(target=self._capture, args=(feed,), name=f"capture:{feed.name}", daemon=True)
            self._threads.append(t)
            t.start()

    def _capture(self, feed: Feed) -> None:
        try:
            while not self._stop.is_set():
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
                if item is None:
                    break
                self._offer(feed, item)
        finally:
            with self._cond:
                feed.ended = True
                self._cond.notify_all()

    def _offer(self, feed: Feed, item: Any) -> None:
        with self._cond:
            if feed.lossless:
                while len(feed.waiting) >= feed.capacity and not self._stop.is_set():
                    feed.source.stats.beat()  # waiting for the pipeline is not a hang
                    self._cond.wait(0.1)
                if self._stop.is_set():
                    feed.left_at_stop += 1
                    return
            elif len(feed.waiting) >= 1:  # latest frame wins, per source
                dropped = sum(isinstance(x, Frame) for x in feed.waiting)
                feed.waiting.clear()
                feed.stale += dropped
                if dropped and self.on_drop is not None:
                    self.on_drop("stale", dropped)
            feed.waiting.append(item)
            self._cond.notify_all()

    # -- the pipeline's side ----------------------------------------------------------------------------
    def read(self, stop: threading.Event) -> Frame | None:
        """The next waiting frame, taking each source in turn; None once every source has ended or `stop` is set."""
        if not self._threads:
            self._start()
        with self._cond:
            while not stop.is_set():
                self._own.beat()
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
                        if item.source != feed.name:  # a folder names its frames per file: keep that as the item
                            item.item, item.source = item.source, feed.name
                        return item
                if all(f.ended for f in self.feeds):
                    self._own.state = "ended"
                    return None
                self._cond.wait(0.1)
        return None

    @property
    def stats(self) -> SourceStats:
        """All sources as one, for the pipeline's own checks: the oldest heartbeat of a source still running
        (a source stuck inside a read is still found), the newest frame of any."""
        st = [f.source.stats for f in self.feeds]
        running = [s for f, s in zip(self.feeds, st) if not f.ended]
        states = {s.state for s in st}
        state = ("ended" if all(f.ended for f in self.feeds) else
                 "open" if "open" in states else "lost" if "lost" in states else next(iter(states)))
        return SourceStats(state=state, frames=sum(s.frames for s in st), bad=sum(s.bad for s in st),
                           reconnects=sum(s.reconnects for s in st), losses=sum(s.losses for s in st),
                           frozen_events=sum(s.frozen_events for s in st),
                           last_frame_ns=max(s.last_frame_ns for s in st),
                           heartbeat=min([s.heartbeat for s in running] or [self._own.heartbeat]))

    def capture_cpu_ms(self) -> float:
        """CPU per frame of the costliest source's capture thread: each source has one, so the slowest bounds."""
        per = [f.source.stats.cpu_ns / 1e6 / f.source.stats.cpu_frames for f in self.feeds if f.source.stats.cpu_frames]
        return max(per, default=0.0)

    def per_source(self) -> dict[str, dict[str, Any]]:
        """Each source's own health: state, counters, frame age, decoder, and what the multiplexer did."""
        now = time.perf_counter_ns()
        out = {}
        for f in self.feeds:
            s = f.source.stats
            out[f.name] = {
                "type": getattr(getattr(f.source, "cfg", None), "type", None), "state": s.state,
                "lossless": f.lossless, "frames": s.frames, "served": f.taken, "stale": f.stale,
                "waiting": len(f.waiting), "left_at_stop": f.left_at_stop, "bad": s.bad,
                "reconnects": s.reconnects, "losses": s.losses, "frozen_events": s.frozen_events,
                "last_frame_age_s": round((now - s.last_frame_ns) / 1e9, 3) if s.last_frame_ns else None,
                "last_error": s.last_error, "decoder": dict(s.decoder),
            }
        return out

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=10)  # each source's read honours its time-outs and the stop event
        for f in self.feeds:
            with self._cond:
                f.left_at_stop += sum(isinstance(x, Frame) for x in f.waiting)
                f.waiting.clear()
            if any(t.is_alive() for t in self._threads if t.name == f"capture:{f.name}"):
                log.warning("source.close_while_reading", source=f.name)  # closed on its thread's way out
                continue
            f.source.close()

