"""Sensor sources: windows of numeric samples from UDP senders, a FIFO / character device / file, or stdin.

Each UDP sender (address), each FIFO writer session and each stdin/file stream is its own *stream*, with
its own buffer and its own place in stream time; a window never mixes samples of two streams. A stream
that ends, restarts, or falls silent for longer than the bundle's reset_on_gap_s (measured in stream
time: arrival beyond the audio the stream already sent) is flushed and starts again, padded as the bundle
declares. Every window carries a StreamSpan: which stream, which session of it, its index and the samples
(and seconds) of stream time it covers; state is carried and reset by that span (agent/spec/inputs.py).
"""

from __future__ import annotations

import os
import select
import socket
import stat
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from agent.config import SourceConfig
from agent.errors import ConfigError
from agent.logsetup import get_logger
from agent.serving.sources import BadFrame, Frame, SourceStats
from agent.spec.manifest import FrameSpec, ResizeSpec

log = get_logger("source")

SENSOR_TYPES = ("udp", "file", "stdin")


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


class SensorFrame(Frame):
    """A sensor window and its place in its stream. `state`: what the engine did with the model's state
    at this window (carried, or why it started again), written when the window ran."""

    __slots__ = ("span", "state")

    def __init__(self, index: int, data: np.ndarray, captured_at: float, captured_ns: int, span: StreamSpan):
        super().__init__(index, data, captured_at, captured_ns, span.stream)
        self.span = span
        self.state: str | None = None


class _Stream:
    """One stream's buffer and clock: samples in, windows out, restarts on a gap in stream time."""

    def __init__(self, name: str, frame: FrameSpec, hop: int, sender: str | None = None):
        self.name, self.frame, self.hop, self.sender = name, frame, hop, sender
        self.session = 0
        self.pending = b""
        self.last_arrival = 0.0
        self._restart("start")

    def resume(self, why: str) -> None:
        """Heard again after it ended (a UDP sender quiet for stream_timeout_s): the next session, saying why."""
        self.reset = why if self.session > 1 else None

    def _restart(self, why: str) -> None:
        self.session += 1
        self.buf = np.empty((0, self.frame.channels), np.float32)
        self.first = -self.frame.pad  # stream sample index of buf[0] (negative: padding)
        self.windows = 0
        self.due: float | None = None  # wall time the received samples would take to arrive in real time
        self.reset = why if self.session > 1 else None
        self.padded = self.frame.pad == 0
        self.skip = 0  # samples still to skip before the next window starts (a hop longer than the window)

    def end(self, why: str) -> int:
        """The stream ended or restarted: its leftover samples are dropped (never start another's window).
        A session that had no sample yet is not ended again: it only takes the newer reason."""
        if not self.windows and not len(self.buf):
            self.pending = b""
            if self.session > 1:
                self.reset = why
            return 0
        # samples no window served: those after the last window's end (its context was served already)
        served_to = self.first - self.hop + self.frame.window if self.windows else 0
        left = max(0, self.first + len(self.buf) - max(served_to, self.first, 0))
        self._restart(why)
        self.pending = b""
        return left

    def push(self, samples: np.ndarray, arrival: float) -> int | None:
        """Add samples that arrived at `arrival` (wall clock); the samples a gap restart dropped, None if none."""
        dropped = None
        gap_s = self.frame.reset_on_gap_s
        if self.windows or len(self.buf):
            if self.frame.sample_rate and self.due is not None:
                gap = arrival - self.due  # silence beyond the audio already sent: stream time, not jitter
            else:  # no sample rate: only the wall time between two arrivals can be measured
                gap = arrival - self.last_arrival
            if gap_s is not None and gap > gap_s:
                dropped = self.end(f"gap of {gap:.3f} s > reset_on_gap_s {gap_s}")
        arrived = len(samples)
        if self.skip:  # between two windows of a hop longer than the window: never served, not leftovers
            n = min(self.skip, arrived)
            samples, self.skip = samples[n:], self.skip - n
        if not self.padded and len(samples):
            fill = np.zeros if self.frame.padding == "zero" else None
            pad = (fill((self.frame.pad, self.frame.channels), np.float32) if fill is not None
                   else np.repeat(samples[:1], self.frame.pad, axis=0))
            self.buf = pad
            self.padded = True
        if len(samples):
            self.buf = np.concatenate([self.buf, samples]) if len(self.buf) else samples
        self.last_arrival = arrival
        if self.frame.sample_rate:
            self.due = max(self.due if self.due is not None else arrival, arrival) + arrived / self.frame.sample_rate
        return dropped

    def pop(self) -> tuple[np.ndarray, StreamSpan] | None:
        w = self.frame.window
        if len(self.buf) < w:
            return None
        win = self.buf[:w].copy()
        span = StreamSpan(self.name, self.session, self.windows, self.first, self.first + w, self.hop,
                          self.frame.sample_rate, self.reset, self.sender)
        self.skip = max(0, self.hop - len(self.buf))
        self.buf = self.buf[self.hop:]
        self.first += self.hop
        self.windows += 1
        self.reset = None
        return win, span


class SensorSource:
    """Sensor windows, each stream on its own: see the module docstring.

    Samples are little-endian `sample_dtype` (default: the bundle's frame.dtype), channels interleaved. A UDP datagram that is not a whole
    number of samples is malformed: counted and dropped. At most `source.max_streams` UDP senders at once;
    a new sender beyond that is refused (its datagrams are counted and dropped) until one goes quiet for
    `source.stream_timeout_s`. A FIFO whose writer goes away is opened again and waits for the next writer.
    """

    def __init__(self, cfg: SourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None, max_scale: int = 8):
        if frame.kind != "sensor":
            raise ConfigError(f"source.type: {cfg.type} delivers sensor windows, but the bundle takes {frame.kind} frames")
        if frame.stateful and cfg.lossless is False:
            raise ConfigError(stateful_lossy_message())
        self.cfg, self.frame = cfg, frame
        # what the feeder sends: the source's sample_dtype, else the bundle's frame.dtype (the model's own
        # samples; a default of float32 read 16-bit PCM as garbage, two samples to a value)
        self.dtype = np.dtype(cfg.sample_dtype or frame.dtype).newbyteorder("<")
        self.sample_bytes = self.dtype.itemsize * frame.channels
        self.hop = cfg.hop or frame.step
        self.max_streams = max(1, cfg.max_streams)
        self.stream_timeout_s = cfg.stream_timeout_s
        self.stats = SourceStats()
        # a stateful model must see every window of a stream in order: lossless hand-over (never latest-wins)
        self.live = cfg.type == "udp" and not frame.stateful
        self.sock: socket.socket | None = None
        self.fd: int | None = None
        self.fifo = False
        self.streams: OrderedDict[Any, _Stream] = OrderedDict()
        # senders whose stream timed out, kept (empty) so one heard again goes on with its next session: its
        # results, state notes and segments never mistake the new stream for the old one (bounded, oldest out)
        self.quiet: OrderedDict[Any, _Stream] = OrderedDict()
        self.refused = 0             # datagrams of senders beyond max_streams
        self.refused_senders: set[Any] = set()  # bounded by max_streams * 4 (a count, not a list, beyond that)
        self.dropped_samples = 0     # leftovers of streams that ended or restarted
        self.restarts = 0
        self._turn = 0
        if cfg.type == "udp":
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.bind((cfg.host, cfg.port))
            self.sock.settimeout(0.2)
            self.name = cfg.name or f"udp:{cfg.host}:{self.sock.getsockname()[1]}"
        elif cfg.type == "stdin":
            self.fd = sys.stdin.buffer.fileno()
            self.name = cfg.name or "stdin"
        else:
            if cfg.path is None:
                raise ConfigError("source.path: a file source needs a FIFO, character device or file")
            self.fifo = cfg.path.exists() and stat.S_ISFIFO(os.stat(cfg.path).st_mode)
            self.fd = os.open(cfg.path, os.O_RDONLY | os.O_NONBLOCK)
            self.name = cfg.name or f"file:{cfg.path}"
        if self.sock is None:
            self.streams[None] = _Stream(self.name, frame, self.hop)
        if frame.reset_on_gap_s is not None and not frame.sample_rate:
            # without a sample rate a gap can only be wall time between two arrivals: chunks that each hold
            # more audio than reset_on_gap_s then reset the state at every chunk
            log.warning("source.gap_in_wall_time", source=self.name, reset_on_gap_s=frame.reset_on_gap_s,
                        fix="declare input.frame.sample_rate so gaps are measured in stream time")
        self.stats.state = "open"

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1] if self.sock else 0

    # -- streams -----------------------------------------------------------------------------------
    def _stream_for(self, addr: Any, now: float) -> _Stream | None:
        s = self.streams.get(addr)
        if s is not None:
            return s
        self._expire(now)
        if len(self.streams) >= self.max_streams:
            self.refused += 1
            if addr not in self.refused_senders and len(self.refused_senders) < self.max_streams * 4:
                self.refused_senders.add(addr)
                log.warning("source.stream_refused", source=self.name, sender=f"{addr[0]}:{addr[1]}",
                            max_streams=self.max_streams, refused=self.refused)
            return None
        s = self.quiet.pop(addr, None)
        if s is not None:
            s.resume(f"sender heard again after it was quiet for {self.stream_timeout_s} s")
        else:
            sender = f"{addr[0]}:{addr[1]}"
            s = _Stream(f"{self.name}/{sender}", self.frame, self.hop, sender)
        self.streams[addr] = s
        self.refused_senders.discard(addr)
        log.info("source.stream_started", source=self.name, stream=s.name, streams=len(self.streams))
        return s

    def _expire(self, now: float) -> None:
        for addr, s in list(self.streams.items()):
            # quiet like a gap, in stream time: beyond the audio the sender already sent (with a sample rate),
            # so a sender ahead of real time is never quiet between its datagrams
            since = s.due if s.due is not None else s.last_arrival
            if now - since > self.stream_timeout_s:
                del self.streams[addr]
                self.dropped_samples += s.end("timed out")
                self.quiet[addr] = s
                while len(self.quiet) > self.max_streams * 4:
                    self.quiet.popitem(last=False)
                log.info("source.stream_ended", source=self.name, stream=s.name, reason="quiet for "
                         f"{self.stream_timeout_s} s")

    def _take(self, s: _Stream, data: bytes, now: float) -> None:
        samples = np.frombuffer(data, self.dtype).astype(np.float32).reshape(-1, self.frame.channels)
        dropped = s.push(samples, now)
        if dropped is not None:
            self.restarts += 1
            self.dropped_samples += dropped
            log.info("source.stream_restarted", source=self.name, stream=s.name, reason=s.reset, dropped_samples=dropped)

    def _ready(self) -> tuple[np.ndarray, StreamSpan] | None:
        """A window of some stream, taking the streams in turn so one fast sender cannot starve the rest."""
        items = list(self.streams.values())
        for k in range(len(items)):
            s = items[(self._turn + k) % len(items)]
            got = s.pop()
            if got is not None:
                self._turn = (self._turn + k + 1) % max(len(items), 1)
                return got
        return None

    # -- reading -----------------------------------------------------------------------------------
    def _receive(self) -> bool:
        """One datagram / read into its stream; False at the end of a file or stdin (a FIFO waits instead)."""
        if self.sock is not None:
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                self._expire(time.time())
                return True
            now = time.time()  # the arrival, after the wait: gaps are measured from it
            if len(data) == 0 or len(data) % self.sample_bytes:
                self.stats.bad += 1
                raise BadFrame(f"{self.name}: datagram of {len(data)} bytes from {addr[0]}:{addr[1]} is not whole "
                               f"samples of {self.sample_bytes} bytes")
            s = self._stream_for(addr, now)
            if s is not None:
                self._take(s, data, now)
            return True
        s = self.streams[None]
        if self.fd is None:  # the FIFO could not be opened again (removed, no permission): retry, never end
            return self._reopen(wait=0.5)
        ready, _, _ = select.select([self.fd], [], [], 0.2)
        if not ready:
            if self.fifo and not self._same_fifo():
                # removed or replaced (a feeder that recreates its FIFO): the old one can never get a writer
                os.close(self.fd)
                self.fd = None
                self.dropped_samples += s.end("FIFO replaced")
                return self._reopen(wait=0.0)
            return True
        data = os.read(self.fd, 65536)
        now = time.time()
        if not data:
            left = s.end("writer restarted")
            self.dropped_samples += left
            if not self.fifo:
                return False
            # the writer went away: wait for the next one (a feeder restart is a new stream, not the end)
            os.close(self.fd)
            self.fd = None
            log.info("source.writer_gone", source=self.name, dropped_samples=left, sessions=s.session - 1)
            return self._reopen(wait=0.0)
        data = s.pending + data
        cut = len(data) - len(data) % self.sample_bytes
        s.pending = data[cut:]
        if cut:
            self._take(s, data[:cut], now)
        return True

    def _same_fifo(self) -> bool:
        assert self.cfg.path is not None and self.fd is not None
        try:
            return os.stat(self.cfg.path).st_ino == os.fstat(self.fd).st_ino
        except OSError:
            return False

    def _reopen(self, wait: float) -> bool:
        assert self.cfg.path is not None
        if wait:
            time.sleep(wait)
        try:
            self.fd = os.open(self.cfg.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            if self.stats.state != "lost":
                self.stats.losses += 1
                log.warning("source.lost", source=self.name, reason=f"cannot reopen the FIFO: {exc.strerror}")
            self.stats.state, self.stats.last_error = "lost", f"cannot reopen {self.cfg.path}: {exc.strerror}"
            return True
        self.stats.reconnects += 1
        self.stats.state = "open"
        return True

    def read(self, stop: threading.Event) -> Frame | None:
        while not stop.is_set():
            self.stats.beat()
            got = self._ready()
            if got is not None:
                win, span = got
                at, ns = time.time(), time.perf_counter_ns()
                if not np.all(np.isfinite(win)):
                    self.stats.bad += 1
                    raise BadFrame(f"{span.stream}: window {span.window} with non-finite samples")
                self.stats.frames += 1
                self.stats.last_frame_ns = ns
                return SensorFrame(self.stats.frames, win, at, ns, span)
            if not self._receive():
                self.stats.state = "ended"
                return None
        return None

    def streams_health(self) -> dict[str, Any]:
        """Per-stream names and counters for health (bounded: at most max_streams streams)."""
        return {"max_streams": self.max_streams, "refused_datagrams": self.refused, "restarts": self.restarts,
                "dropped_samples": self.dropped_samples,
                "streams": {s.name: {"session": s.session, "windows": s.windows, "buffered": len(s.buf)}
                            for s in self.streams.values()}}

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.fd is not None and self.cfg.type != "stdin":
            os.close(self.fd)
            self.fd = None


def stateful_lossy_message(where: str = "source") -> str:
    return (f"{where}.lossless: false drops windows, but the bundle carries state (inputs with kind: state): a "
            "stateful model must see every window of a stream in order. Remove source.lossless (stateful bundles "
            "default to lossless) or serve a stateless bundle")


def stream_problems(frame: FrameSpec, inputs: Sequence[Any], sources: Sequence[SourceConfig],
                    keys: Sequence[str]) -> list[str]:
    """What `config check` refuses about serving this bundle's frames from these sources."""
    out = []
    states = [f"inputs[{i}] ({x.name}, kind: state)" for i, x in enumerate(inputs) if x.kind == "state"]
    for key, src in zip(keys, sources):
        if states and src.lossless is False:
            out.append(f"key {key}.lossless: false with a stateful bundle ({', '.join(states)}): windows would be "
                       "dropped and the state carried across the hole; remove the key (stateful bundles default to "
                       "lossless)")
    return out


def stream_record(frame: Frame) -> Mapping[str, Any] | None:
    """The stream a result came from, for the result (None for frames that are not sensor windows)."""
    span = getattr(frame, "span", None)
    if span is None:
        return None
    rec = span.record()
    state = getattr(frame, "state", None)
    if state is not None:
        rec["state"] = state
    return rec
