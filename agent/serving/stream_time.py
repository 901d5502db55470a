"""One sensor stream's buffer and clock: samples in, windows out, a new session at each hole in stream time.

A stream's clock is the samples it delivered. A hole is something the stream itself did -- a sender that
stopped for longer than reset_on_gap_s (silence the reader *witnessed*: measured from when it found the
transport empty, or from the kernel's arrival time of a datagram), datagrams the kernel dropped, a writer
that reopened, a backlog shed to keep up -- never the agent's own backlog: samples that waited in a pipe
or a buffer while inference was behind are consecutive samples, whenever they are read. At a hole the
windows the old session can still fill are served first; the samples no window can serve are counted
(`dropped_samples`: leftovers; `lost_samples`: audio that never reached a window), and the new session's
first window says why (`StreamSpan.reset`), so the state starts again there and is never carried across.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from agent.serving.sample_buffer import Samples
from agent.vocabulary.manifest import FrameSpec

RATE_SPAN_S = 2.0  # a sender's rate is measured over this much wall time of its arrivals
RATE_TOLERANCE = 0.1  # a measured rate further than this (relative) from the declared one is reported


@dataclass(frozen=True)
class StreamSpan:
    """Where one window sits in its stream: samples [start, end) of session `session` of `stream`.

    Samples count from the stream's first real sample (padding is before 0, so a padded first window
    starts below 0). `reset`: why the stream (and its state) starts again at this window, else None.
    """

    stream: str
    session: int
    window: int  # index within the session, from 0
    start: int
    end: int
    step: int  # the frame's hop: the last `step` samples are this window's own (the rest is context)
    sample_rate: float | None = None
    reset: str | None = None
    sender: str | None = None  # a UDP stream's sender (host:port): a stream of its own within its source

    def seconds(self, sample: int) -> float | None:
        return None if not self.sample_rate else round(sample / self.sample_rate, 6)

    @property
    def own_start(self) -> int:
        """The first of the samples this window adds to the stream (the window's time for decisions)."""
        return self.end - self.step

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.stream, "session": self.session, "window": self.window,
                               "start_sample": self.start, "end_sample": self.end}
        if self.sample_rate:
            out.update(start_s=self.seconds(self.start), end_s=self.seconds(self.end))
        if self.reset:
            out["reset"] = self.reset
        if self.sender:  # its results go to their own MQTT topic, predictions/<stream> (agent.serving.sinks)
            out["sender"] = self.sender
        return out


def lost_reason(samples: int, why: str) -> str:
    return f"{samples:,} samples lost ({why})"


class Stream:
    """One stream's buffer and clock: see the module docstring. Not thread-safe: its source locks."""

    def __init__(self, name: str, frame: FrameSpec, hop: int, sender: str | None = None):
        self.name, self.frame, self.hop, self.sender = name, frame, hop, sender
        self.session = 0
        self.pending = b""
        self.last_arrival = 0.0
        # full windows of sessions that ended, each with its own real samples (disposed of once served)
        self.closed: deque[tuple[np.ndarray, StreamSpan, int]] = deque()
        self.received = 0  # real samples delivered, over every session
        self.largest = 0  # the largest delivery: a sender's datagram size, for datagrams the socket dropped
        self.disposed = 0  # of those, in the order delivered: served in a window, skipped, dropped or lost
        self.behind = 0  # leftovers dropped at a hole while the windows before them still wait (see _close)
        # windows taken by the pipeline and not yet served or dropped: ((session, window), their own samples,
        # the arrival of the oldest of them); still the agent's backlog (settle() removes them, and every one
        # taken before, when one is done), with their own arrival times (a shed forgets only the samples it drops)
        self.taken: deque[tuple[tuple[int, int], int, float | None]] = deque()
        self.in_flight = 0
        self.arrivals: deque[tuple[int, float]] = deque()  # (received after a delivery, its arrival)
        self.lost_samples = 0
        self.dropped_samples = 0
        self.measured_rate: float | None = None
        self.rate_said = False  # a rate off the declared one was logged (once per stream)
        self.next_seq: int | None = None  # the sequence number the sender's next datagram should carry
        self.late_datagrams = 0  # datagrams whose sequence number was already passed (late, duplicated)
        # seq32: a datagram whose number was already passed, held until the next one says whether it was late
        # (dropped) or the first of a sender that restarted its numbering (agent/serving/sensor_losses.py)
        self.held_back: tuple[int, bytes, float] | None = None
        self.restart_due = False  # a session ended (writer gone, timed out): its next samples count a restart
        self.lost_range: tuple[int, int] | None = None  # seq32: (first, count) of the numbers last counted lost
        self._rate_from: tuple[float, int] | None = None
        self._restart("start")

    def resume(self, why: str) -> None:
        """Heard again after it ended (a UDP sender quiet for stream_timeout_s): the next session, saying why."""
        self.reset = why if self.session > 1 else None

    def _restart(self, why: str) -> None:
        self.session += 1
        self.buf = Samples(self.frame.channels)
        self.first = -self.frame.pad  # stream sample index of buf[0] (negative: padding)
        self.windows = 0
        self.served_to = 0  # the end of this session's last window (its samples are served)
        self.due: float | None = None  # wall time the received samples would take to arrive in real time
        self.reset = why if self.session > 1 else None
        self.padded = self.frame.pad == 0
        self.skip = 0  # samples still to skip before the next window starts (a hop longer than the window)
        # the rate clock runs on across sessions (a sender slower than declared has a gap at every delivery)

    def _close(self) -> int:
        """End this session: the windows it can still fill are kept (served before the next session's);
        returns the samples no window of it will serve."""
        while True:
            before = self.disposed
            got = self._pop_current()
            if got is None:
                break
            own, self.disposed = self.disposed - before, before  # disposed of when served, not before
            self.closed.append((*got, own))
        if not self.windows and not len(self.buf):
            return 0
        # samples no window served: those after the last window's end (its context was served already)
        left = max(0, self.first + len(self.buf) - max(self.served_to, self.first, 0))
        # the newest samples: gone now, but behind the closed windows in the order samples are served
        self.behind += left
        self._settle()
        return left

    def end(self, why: str) -> int:
        """The stream ended or restarted: its leftover samples are dropped (never start another's window).
        A session that had no sample yet is not ended again: it only takes the newer reason."""
        self.pending = b""
        if not self.windows and not len(self.buf):
            if self.session > 1:
                self.reset = why
            return 0
        left = self._close()
        self.dropped_samples += left
        self._restart(why)
        return left

    def hole(self, lost: int, reason: str) -> int:
        """Samples that never arrived (datagrams the kernel dropped; `lost` where known, else 0): a new
        session after what came before, its first window saying `reason`. Returns the old session's
        leftover samples (dropped: fewer than a window)."""
        self.lost_samples += lost
        if lost:
            self._rate_from = None  # samples that never arrived: the rate is measured afresh from here
        if not self.received:
            return 0  # nothing of this stream yet: it starts at its first sample, no state to reset
        if not self.windows and not len(self.buf) and self.session > 1:
            self.reset = reason  # a session with no sample yet: it only takes the newer reason
            return 0
        left = self._close()
        self.dropped_samples += left
        self._restart(reason)
        return left

    def shed(self, why: str) -> int:
        """Drop every sample not yet served (the agent fell too far behind): counted as lost, and the stream
        starts again at the samples that come next. Returns the samples lost."""
        lost = self.backlog
        self.closed.clear()
        self.buf = Samples(self.frame.channels)
        self.disposed, self.behind = self.received, 0
        self.lost_samples += lost
        self.arrivals.clear()
        self._restart(lost_reason(lost, why))
        return lost

    def _settle(self) -> None:
        if not self.closed:  # the windows before the dropped leftovers are served: count them as disposed
            self.disposed, self.behind = self.disposed + self.behind, 0

    @property
    def backlog(self) -> int:
        """Real samples delivered and not yet served (or dropped)."""
        return self.received - self.disposed - self.behind

    def settle(self, span: StreamSpan) -> None:
        """The pipeline published (or dropped) this window. Windows are served in order within a stream, so
        any taken before it are done too: one the pipeline dropped without a word leaves with the next."""
        key = (span.session, span.window)
        while self.taken and self.taken[0][0] <= key:
            self.in_flight -= self.taken.popleft()[1]

    def settle_dropped(self, span: StreamSpan) -> int:
        """The pipeline dropped this window (latest-frame-wins, a refused or failed run): settled, and its own
        samples counted as dropped in this stream. Returns them (0 when it was settled already)."""
        key = (span.session, span.window)
        own = next((n for k, n, _ in self.taken if k == key), 0)
        self.settle(span)
        self.dropped_samples += own
        return own

    def _forget_served(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.disposed:
            self.arrivals.popleft()

    def oldest_unserved(self) -> float | None:
        """The arrival of the oldest sample no window has served yet (taken windows the pipeline still works on
        included), None when none waits."""
        if self.taken:  # the pipeline takes windows in order: the oldest taken is the oldest unserved
            return self.taken[0][2]
        self._forget_served()
        return self.arrivals[0][1] if self.arrivals and self.backlog else None

    def push(self, samples: np.ndarray, arrival: float, idle_since: float | None = 0.0) -> int | None:
        """Add samples that arrived at `arrival` (wall clock); the samples a gap restart dropped, None if none.

        `idle_since`: since when the reader had found the transport empty before these samples came -- the
        silence it witnessed; 0.0 where `arrival` is exact (a kernel timestamp: any silence before it is the
        sender's); None where the samples were already waiting when read, so no silence was witnessed (the
        agent's own backlog: never a gap)."""
        dropped = None
        gap_s = self.frame.reset_on_gap_s
        if (self.windows or len(self.buf)) and idle_since is not None:
            since = self.due if (self.frame.sample_rate and self.due is not None) else self.last_arrival
            gap = arrival - max(since, idle_since)  # silence beyond the audio already sent: stream time
            if gap_s is not None and gap > gap_s:
                dropped = self.end(f"gap of {gap:.3f} s > reset_on_gap_s {gap_s}")
        arrived = len(samples)
        self.received += arrived
        self.largest = max(self.largest, arrived)
        self.arrivals.append((self.received, arrival))
        self._measure(arrival, arrived, idle_since is not None)
        if self.skip:  # between two windows of a hop longer than the window: never served, not leftovers
            n = min(self.skip, arrived)
            samples, self.skip = samples[n:], self.skip - n
            self.disposed += n
        if not self.padded and len(samples):
            fill = np.zeros if self.frame.padding == "zero" else None
            pad = (fill((self.frame.pad, self.frame.channels), np.float32) if fill is not None
                   else np.repeat(samples[:1], self.frame.pad, axis=0))
            self.buf.append(pad)
            self.padded = True
        if len(samples):
            self.buf.append(samples)
        self.last_arrival = arrival
        if self.frame.sample_rate:
            self.due = max(self.due if self.due is not None else arrival, arrival) + arrived / self.frame.sample_rate
        return dropped

    def _measure(self, arrival: float, arrived: int, exact: bool) -> None:
        """The sender's rate over RATE_SPAN_S of arrivals the reader saw as they came (not a backlog's)."""
        if not exact:
            self._rate_from = None
            return
        if self._rate_from is None:
            self._rate_from = (arrival, self.received)
            return
        t0, n0 = self._rate_from
        if arrival - t0 >= RATE_SPAN_S:
            self.measured_rate = (self.received - n0) / (arrival - t0)  # the samples that came after t0
            self._rate_from = (arrival, self.received)

    def rate_off(self) -> float | None:
        """The measured rate over the declared one, where it is off by more than RATE_TOLERANCE."""
        sr = self.frame.sample_rate
        if not sr or self.measured_rate is None:
            return None
        ratio = self.measured_rate / sr
        return ratio if abs(ratio - 1) > RATE_TOLERANCE else None

    def _pop_current(self) -> tuple[np.ndarray, StreamSpan] | None:
        w = self.frame.window
        if len(self.buf) < w:
            return None
        win = self.buf.head(w)
        span = StreamSpan(self.name, self.session, self.windows, self.first, self.first + w, self.hop,
                          self.frame.sample_rate, self.reset, self.sender)
        self.disposed += span.end - max(span.start, self.served_to, 0)  # this window's own real samples
        self.served_to = span.end
        self.disposed += max(0, min(self.hop, len(self.buf)) - w)  # skipped between windows (hop > window)
        self.skip = max(0, self.hop - len(self.buf))
        self.buf.drop(self.hop)
        self.first += self.hop
        self.windows += 1
        self.reset = None
        return win, span

    def pop(self) -> tuple[np.ndarray, StreamSpan] | None:
        """The next window: those of a session that ended first, then the current session's. Its own samples
        stay in the backlog, in flight, until settle() says the pipeline is done with it."""
        self._forget_served()
        oldest = self.arrivals[0][1] if self.arrivals else None  # of the first sample not yet disposed of
        if self.closed:
            win, span, own = self.closed.popleft()
            self.disposed += own
            self._settle()
            got: tuple[np.ndarray, StreamSpan] | None = (win, span)
        else:
            served_to = max(self.served_to, 0)
            got = self._pop_current()
            own = 0 if got is None else got[1].end - max(got[1].start, served_to, 0)
        if got is not None and own > 0:
            self.taken.append(((got[1].session, got[1].window), own, oldest))
            self.in_flight += own
        self._forget_served()  # bounded by what waits
        return got

    @property
    def ready(self) -> bool:
        return bool(self.closed) or len(self.buf) >= self.frame.window

    def health(self, now: float, in_pipe: int = 0) -> dict[str, Any]:
        """`in_pipe`: samples still waiting in the pipe the stream is read from (its backlog too)."""
        # behind only while a window waits to be served: samples waiting for the rest of their window (a writer
        # that paused mid-window) are not the agent's backlog in time
        oldest = self.oldest_unserved() if self.ready or self.in_flight else None
        sr = self.frame.sample_rate
        backlog = self.backlog + self.in_flight + in_pipe  # taken by the pipeline and not yet served: behind too
        out: dict[str, Any] = {"session": self.session, "windows": self.windows, "buffered": len(self.buf),
                               "lost_samples": self.lost_samples, "dropped_samples": self.dropped_samples,
                               "backlog_samples": backlog,
                               "oldest_unserved_age_s": round(max(0.0, now - oldest), 3) if oldest else 0.0}
        if sr:
            out["backlog_s"] = round(backlog / sr, 3)
        if self.next_seq is not None:
            # a loss at a stream's end shows only when a later payload arrives: compare with the sender's counter
            out["next_sequence"] = self.next_seq
        if self.measured_rate is not None:
            out["measured_rate"] = round(self.measured_rate, 1)
            off = self.rate_off()
            if off is not None:  # the measured rate over the declared one: the sender is not what was declared
                out["rate_off_by"] = round(off, 3)
        return out


def stream_record(frame: Any) -> Mapping[str, Any] | None:
    """The stream a result came from, for the result (None for frames that are not sensor windows)."""
    span = getattr(frame, "span", None)
    if span is None:
        return None
    rec = span.record()
    state = getattr(frame, "state", None)
    if state is not None:
        rec["state"] = state
    return rec
