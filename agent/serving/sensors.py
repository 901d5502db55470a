"""Sensor sources: windows of numeric samples from UDP senders, a FIFO / character device / file, or stdin.

Each UDP sender (address), each FIFO writer session and each stdin/file stream is its own *stream*, with
its own buffer and its own place in stream time (agent/serving/stream_time.py); a window never mixes
samples of two streams. A stream that ends, restarts, loses samples (datagrams the socket dropped, a
backlog shed) or falls silent for longer than the bundle's reset_on_gap_s (in stream time, never the
agent's own backlog) starts a new session, padded as the bundle declares, and says why. Every window
carries a StreamSpan: which stream, which session of it, its index and the samples (and seconds) of
stream time it covers; state is carried and reset by that span (agent/vocabulary/inputs.py)."""

from __future__ import annotations

import fcntl
import os
import select
import socket
import stat
import struct
import sys
import termios
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable

import numpy as np

from agent.config import SourceConfig
from agent.source_types import FileSourceConfig, MqttSourceConfig, NetworkKeys, SampleKeys, StdinSourceConfig, UdpSourceConfig
from agent.errors import ConfigError
from agent.logsetup import get_logger
from agent.serving.sources import BadFrame, Frame, SourceStats
from agent.serving.stream_time import Stream, StreamSpan, lost_reason
from agent.serving.sensor_losses import SEQ, SEQ_BYTES
from agent.serving.sensor_checks import (declared_mismatch, mqtt_stateful_message, mqtt_unframed_message,  # noqa: F401
                                        stateful_lossy_message, stream_problems)  # (the config check's, named here too)
from agent.serving.sensor_mqtt import MqttSamples
from agent.serving.udp_receive import Datagram, Datagrams
from agent.vocabulary.manifest import FrameSpec, ResizeSpec

log = get_logger("source")

SESSION_MEMORY = 16384  # quiet senders whose session number is remembered beyond the max_streams x 4 kept whole



class SensorFrame(Frame):
    """A sensor window and its place in its stream. `state`: what the engine did with the model's state
    at this window (carried, or why it started again), written when the window ran."""

    __slots__ = ("span", "state", "_on_settled")

    def __init__(self, index: int, data: np.ndarray, captured_at: float, captured_ns: int, span: StreamSpan,
                 on_settled: Callable[[StreamSpan, bool], None] | None = None):
        super().__init__(index, data, captured_at, captured_ns, span.stream)
        self.span = span
        self.state: str | None = None
        self._on_settled = on_settled

    def settled(self, dropped: bool = False) -> None:
        """Served or dropped: the window leaves its stream's backlog (once); a dropped one is counted there."""
        call, self._on_settled = self._on_settled, None
        if call is not None:
            call(self.span, dropped)


_Stream = Stream  # the name the stream-time tests import


class SensorSource(MqttSamples):
    """Sensor windows, each stream on its own: see the module docstring.

    Samples are little-endian `sample_dtype` (default: the bundle's frame.dtype), channels interleaved. A UDP
    datagram that is not a whole number of samples is malformed: counted and dropped. At most
    `source.max_streams` UDP senders at once; a new sender beyond that is refused (its datagrams are counted
    and dropped) until one goes quiet for `source.stream_timeout_s`. A FIFO whose writer goes away is opened
    again and waits for the next writer.

    UDP is read by a thread of its own, whatever the pipeline does: a sender cannot be slowed down, so its
    datagrams are taken off the socket as they come (their kernel arrival time kept) and wait in their
    stream's buffer, at most `source.max_backlog_s` of them. A FIFO, file or stdin is read by a thread of its
    own too, as the writer writes (so its pauses and its end are seen when they happen), into a buffer of at
    most `source.max_backlog_s`: beyond that the pipe is left unread and the writer blocks (backpressure,
    said in the log and health's `held`), and nothing is lost.
    """

    name: str  # udp:host:port, file:path, stdin, mqtt:host:port/topic unless the config names it

    def __init__(self, cfg: SourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None, max_scale: int = 8):
        if frame.kind != "sensor":
            raise ConfigError(f"source.type: {cfg.type} delivers sensor windows, but the bundle takes {frame.kind} frames")
        if not isinstance(cfg, SampleKeys):
            raise ConfigError(f"source.type: {cfg.type} does not deliver sensor samples")
        why = declared_mismatch(frame, cfg)
        if why is not None:
            raise ConfigError(why)
        if frame.stateful and cfg.lossless is False:
            raise ConfigError(stateful_lossy_message())
        if frame.stateful and isinstance(cfg, MqttSourceConfig) and cfg.payload == "samples" and cfg.framing != "seq32":
            raise ConfigError(mqtt_unframed_message())  # a hole the broker made could not be seen: as config check
        self.cfg, self.frame = cfg, frame
        # what the feeder sends: the source's sample_dtype, else the bundle's frame.dtype (its model's own samples)
        self.dtype = np.dtype(cfg.sample_dtype or frame.dtype).newbyteorder("<")
        self.sample_bytes = self.dtype.itemsize * frame.channels
        self.hop = cfg.hop or frame.step
        udp = cfg if isinstance(cfg, UdpSourceConfig) else UdpSourceConfig()  # a type without the udp keys: their defaults
        self.max_streams = max(1, udp.max_streams)
        self.stream_timeout_s = udp.stream_timeout_s
        self.max_backlog_s = cfg.max_backlog_s if isinstance(cfg, NetworkKeys) else NetworkKeys.max_backlog_s
        # a stream's unserved samples beyond this are shed (counted as lost): without a sample rate, at 16 kHz's
        self.max_backlog = int(self.max_backlog_s * (frame.sample_rate or 16000))
        self.path = cfg.path if isinstance(cfg, FileSourceConfig) else None  # a FIFO, device or file
        self.stats = SourceStats()
        # a stateful model must see every window of a stream in order: lossless hand-over (never latest-wins)
        self.live = isinstance(cfg, UdpSourceConfig) and not frame.stateful
        self.sock: socket.socket | None = None
        self.datagrams: Datagrams | None = None
        self.fd: int | None = None
        self.fifo = False
        self.streams: OrderedDict[Any, Stream] = OrderedDict()
        # senders whose stream timed out, kept (empty; beyond max_streams x 4 their session number only) so one
        # heard again goes on with its next session: never mistaken for the old stream (bounded, oldest out)
        self.quiet: OrderedDict[Any, Stream] = OrderedDict()
        self.sessions_of: OrderedDict[Any, int] = OrderedDict()
        self.refused = 0             # datagrams of senders beyond max_streams
        self.refused_senders: set[Any] = set()  # bounded by max_streams * 4 (a count, not a list, beyond that)
        self.dropped_samples = 0     # leftovers of streams that ended or restarted
        self.lost_samples = 0        # samples that never reached a window: shed to keep up, or known lost
        self.lost_datagrams = 0      # datagrams the socket dropped (its receive buffer was full)
        self.restarts = 0
        self.late_datagrams = 0      # sequenced datagrams that came after their place was passed
        self.sequenced = isinstance(cfg, (UdpSourceConfig, MqttSourceConfig)) and cfg.framing == "seq32"
        self.unit = "payloads" if isinstance(cfg, MqttSourceConfig) else "datagrams"  # what a sequence number numbers
        self._drop_count = 0         # the socket's drop counter as last seen
        self._turn = 0
        self._cond = threading.Condition()  # streams are filled by the UDP thread and emptied by read()
        self._bad: deque[str] = deque(maxlen=64)  # malformed datagrams, raised from read() as BadFrame
        self._closing = threading.Event()
        self._idle_since: float | None = None  # a pipe: since when the reader has watched it empty
        self._ended = threading.Event()  # a file or stdin was read to its end (a FIFO never ends)
        self.held = 0                # times a pipe was left unread: its stream's buffer was full (backpressure)
        self._holding = False        # a pipe is left unread now
        self._hup_left: int | None = None  # a FIFO writer gone while held: its bytes still unread (_watch_hangup)
        self._thread: threading.Thread | None = None
        self.client: Any = None  # paho's client for an mqtt source
        self._pushed = isinstance(cfg, NetworkKeys)  # UDP, MQTT: no pipe whose unread bytes are a backlog (_in_pipe)
        self.topic: str | None = None  # mqtt: the one topic the samples arrive on
        self._mqtt_idle: float | None = 0.0  # mqtt: since when paho's thread found the connection empty
        if isinstance(cfg, UdpSourceConfig):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.bind((cfg.host, cfg.port))
            self.sock.settimeout(0.2)
            self.datagrams = Datagrams(self.sock, cfg.receive_buffer_bytes)
            self.name = cfg.name or f"udp:{cfg.host}:{self.sock.getsockname()[1]}"
        elif isinstance(cfg, MqttSourceConfig):
            self.name = self._mqtt_open(cfg)
        elif isinstance(cfg, StdinSourceConfig):
            self.fd = sys.stdin.buffer.fileno()
            self.name = cfg.name or "stdin"
        else:
            if self.path is None:
                raise ConfigError("source.path: a file source needs a FIFO, character device or file")
            self.fifo = self.path.exists() and stat.S_ISFIFO(os.stat(self.path).st_mode)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            self.name = cfg.name or f"file:{self.path}"
        if self.sock is None:  # one stream (a pipe's, or an MQTT topic's)
            self.streams[None] = Stream(self.name, frame, self.hop)
        if frame.reset_on_gap_s is not None and not frame.sample_rate:
            # without a sample rate a gap can only be wall time between two arrivals: chunks that each hold
            # more audio than reset_on_gap_s then reset the state at every chunk
            log.warning("source.gap_in_wall_time", source=self.name, reset_on_gap_s=frame.reset_on_gap_s,
                        fix="declare input.frame.sample_rate so gaps are measured in stream time")
        self.stats.state = "open"
        if self.client is not None:
            self.client.connect_async(cfg.host, cfg.port or 1883, 30)
            self.client.loop_start()
        if self.sock is not None:
            self._thread = threading.Thread(target=self._udp_loop, name=f"udp-receive {self.name}", daemon=True)
            self._thread.start()
        elif self.client is None:  # a FIFO, device, file or stdin: read on its own thread too (see _pipe_loop)
            self._thread = threading.Thread(target=self._pipe_loop, name=f"pipe-read {self.name}", daemon=True)
            self._thread.start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1] if self.sock else 0

    # -- streams -----------------------------------------------------------------------------------
    def _stream_for(self, addr: Any, now: float) -> Stream | None:
        s = self.streams.get(addr)
        if s is not None and not self._timed_out(s, now):
            return s
        # a new sender, or this one heard again after stream_timeout_s (whatever the others kept doing)
        self._expire(now)
        if len(self.streams) >= self.max_streams:
            self.refused += 1
            if addr not in self.refused_senders and len(self.refused_senders) < self.max_streams * 4:
                self.refused_senders.add(addr)
                log.warning("source.stream_refused", source=self.name, sender=f"{addr[0]}:{addr[1]}",
                            max_streams=self.max_streams, refused=self.refused)
            return None
        s = self.quiet.pop(addr, None)
        why = f"sender heard again after it was quiet for {self.stream_timeout_s} s"
        if s is not None:
            s.resume(why)
            # its earlier losses stay in the source's totals (/metrics: stream "(ended)"); counted anew from here
            s.lost_samples = s.dropped_samples = 0
        else:
            sender = f"{addr[0]}:{addr[1]}"
            s = Stream(f"{self.name}/{sender}", self.frame, self.hop, sender)
            session = self.sessions_of.pop(addr, None)
            if session is not None:  # its stream forgotten, its place in it not: the next session, said
                s.session, s.restart_due = session, True
                s.resume(why)
        self.streams[addr] = s
        self.refused_senders.discard(addr)
        log.info("source.stream_started", source=self.name, stream=s.name, streams=len(self.streams))
        return s

    def _timed_out(self, s: Stream, now: float) -> bool:
        """Quiet like a gap, in stream time: beyond the audio the sender already sent (with a sample rate), so
        a sender ahead of real time is never quiet between its datagrams. A stream with windows still to serve
        is behind, not quiet."""
        since = s.due if s.due is not None else s.last_arrival
        return not s.ready and now - since > self.stream_timeout_s

    def _expire(self, now: float) -> None:
        for addr, s in list(self.streams.items()):
            if not self._timed_out(s, now):
                continue
            del self.streams[addr]
            self._late(s)  # a number held back: late, its successor never came
            before = s.session
            self.dropped_samples += s.end("timed out")
            s.restart_due = s.session > before  # counted in restarts when heard again
            s.next_seq = None  # heard again: a new session, whatever number its sender is at
            self.quiet[addr] = s
            while len(self.quiet) > self.max_streams * 4:  # beyond: only its session number is remembered
                old, gone = self.quiet.popitem(last=False)
                self.sessions_of[old] = gone.session
            while len(self.sessions_of) > SESSION_MEMORY:
                self.sessions_of.popitem(last=False)
            log.info("source.stream_ended", source=self.name, stream=s.name, reason="quiet for "
                     f"{self.stream_timeout_s} s")

    def _take(self, s: Stream, data: bytes, arrival: float, idle_since: float | None) -> None:
        samples = np.frombuffer(data, self.dtype).astype(np.float32).reshape(-1, self.frame.channels)
        if self.dtype.kind == "f" and not np.all(np.isfinite(samples)):
            # a broken sender: the delivery (datagram, payload, read) is dropped whole, a hole counted in its
            # stream (its state never carried across; no window mixes good samples with its neighbours')
            self.stats.bad += 1
            self._bad.append(f"{s.name}: {len(samples)} samples with non-finite values dropped")
            self.lost_samples += len(samples)
            self._hole(s, len(samples), lost_reason(len(samples), "non-finite samples dropped"))
            return
        if s.restart_due:  # the first samples of a new session after one that ended (writer, sender back)
            s.restart_due = False
            self.restarts += 1
        dropped = s.push(samples, arrival, idle_since)
        if dropped is not None:
            self.restarts += 1
            self.dropped_samples += dropped
            log.info("source.stream_restarted", source=self.name, stream=s.name, reason=s.reset, dropped_samples=dropped)
        ratio = s.rate_off()
        if ratio is not None and not s.rate_said:
            s.rate_said = True
            log.warning("source.rate_mismatch", source=self.name, stream=s.name, declared=self.frame.sample_rate,
                        measured=round(s.measured_rate or 0.0, 1), ratio=round(ratio, 3),
                        fix="send at the rate the bundle declares (input.frame.sample_rate): a stream at another "
                            "rate is served wrong, and one slower than real time is late")

    def _shed(self, s: Stream) -> None:
        """Beyond max_backlog_s behind: the stream's unserved samples are dropped and counted, and it starts
        again at the newest audio (the state with it: never carried across the hole)."""
        if s.backlog <= self.max_backlog:
            return
        lost = s.shed(f"the agent was more than source.max_backlog_s {self.max_backlog_s} s behind")
        self.lost_samples += lost
        self.restarts += 1
        log.warning("source.backlog_shed", source=self.name, stream=s.name, lost_samples=lost,
                    max_backlog_s=self.max_backlog_s)

    def _ready(self) -> tuple[np.ndarray, StreamSpan, Stream] | None:
        """A window of some stream, taking the streams in turn so one fast sender cannot starve the rest."""
        items = list(self.streams.values())
        for k in range(len(items)):
            s = items[(self._turn + k) % len(items)]
            got = s.pop()
            if got is not None:
                self._turn = (self._turn + k + 1) % max(len(items), 1)
                return (*got, s)
        return None

    # -- reading -----------------------------------------------------------------------------------
    def _pipe_loop(self) -> None:
        """The pipe thread (FIFO, device, file, stdin): read as the writer writes, whatever the pipeline does,
        so a writer's pause and a writer that closes are seen when they happen (read late, behind the agent's
        backlog, a pause was never watched and an end-of-file never seen before the next writer's samples).
        The stream's buffer is bounded (source.max_backlog_s of samples): when full, the pipe is left unread,
        so the writer blocks on it (backpressure: nothing lost, no state reset) and the reader says so."""
        try:
            while not self._closing.is_set():
                with self._cond:
                    if self.streams[None].backlog >= self.max_backlog:
                        self._hold()
                        self._cond.wait(0.2)
                        continue
                    if self._holding:
                        self._holding = False
                        log.info("source.reading_again", source=self.name)
                try:
                    if not self._receive():
                        return
                except OSError as exc:
                    if self._closing.is_set():
                        return
                    log.warning("source.receive_failed", source=self.name, error=str(exc))
                    self._closing.wait(0.2)
        finally:
            self._ended.set()
            with self._cond:
                self._cond.notify_all()

    def _hold(self) -> None:
        """The buffer is full: stop reading. What the writer writes meanwhile waits in the pipe (the agent's
        backlog, never a gap); a pause of the writer's while held cannot be seen, which is said here."""
        self._idle_since = None  # not watching: what waits in the pipe when reading again is backlog
        self._watch_hangup()
        if not self._holding:
            self._holding = True
            self.held += 1
            log.warning("source.backpressure", source=self.name, held=self.held, max_backlog_s=self.max_backlog_s,
                        detail="the agent is max_backlog_s behind: the pipe is left unread and its writer "
                               "blocks; a pause of the writer's meanwhile is not seen",
                        fix="give the agent more CPU, or write no faster than real time")

    def _watch_hangup(self) -> None:
        """While held, a FIFO whose writer has gone shows POLLHUP although its bytes still wait unread: those
        are the last writer's, so the stream ends once they are read, and a writer that opens meanwhile starts
        a new session (read late, its bytes would follow the old writer's with no end-of-file between). A writer
        that leaves and another that opens within one check (0.2 s) cannot be told apart."""
        if not self.fifo or self.fd is None or self._hup_left is not None:
            return
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if any(ev & select.POLLHUP for _, ev in poller.poll(0)):
            self._hup_left = self._pipe_bytes()

    def _udp_loop(self) -> None:
        """The UDP thread: every datagram off the socket as it comes, into its stream."""
        while not self._closing.is_set():
            try:
                self._receive()
            except OSError as exc:
                if self._closing.is_set():
                    return
                log.warning("source.receive_failed", source=self.name, error=str(exc))
                self._closing.wait(0.2)

    def _receive(self) -> bool:
        """One datagram / read into its stream; False at the end of a file or stdin (a FIFO waits instead)."""
        if self.datagrams is not None:
            try:
                d = self.datagrams.receive()
            except TimeoutError:
                with self._cond:
                    self._quiet_drops()  # drops at a burst's end: no later datagram carries them
                    self._expire(time.time())
                return True
            with self._cond:
                self._datagram(d)
                self._cond.notify_all()
            return True
        s = self.streams[None]
        if self.fd is None:  # the FIFO could not be opened again (removed, no permission): retry, never end
            return self._reopen(wait=0.5)
        ready, _, _ = select.select([self.fd], [], [], 0)
        if not ready:
            if self._idle_since is None:
                self._idle_since = time.time()  # from here the reader watches: silence from now is the writer's
            ready, _, _ = select.select([self.fd], [], [], 0.2)
        if not ready:
            if self.fifo and not self._same_fifo():
                # removed or replaced (a feeder that recreates its FIFO): the old one can never get a writer
                with self._cond:  # health reads the stream and the pipe's fd
                    os.close(self.fd)
                    self.fd = None
                    self._end_writer(s, "FIFO replaced")
                return self._reopen(wait=0.0)
            return True
        hup = self._hup_left
        if hup == 0:  # the writer that left while the pipe was held: all its bytes are read
            with self._cond:
                self._hup_left = None
                left = self._end_writer(s, "writer restarted")
            log.info("source.writer_gone", source=self.name, dropped_samples=left, sessions=s.session - 1)
            return True
        data = os.read(self.fd, 65536 if hup is None else min(hup, 65536))
        now, idle_since = time.time(), self._idle_since
        self._idle_since = None
        if hup is not None:
            self._hup_left = max(0, hup - len(data)) if data else None
        if not data:
            with self._cond:
                left = self._end_writer(s, "writer restarted")
                self._cond.notify_all()
                if not self.fifo:
                    return False
                # the writer went away: wait for the next one (a feeder restart is a new stream, not the end)
                os.close(self.fd)
                self.fd = None
            log.info("source.writer_gone", source=self.name, dropped_samples=left, sessions=s.session - 1)
            return self._reopen(wait=0.0)
        with self._cond:
            data = s.pending + data
            cut = len(data) - len(data) % self.sample_bytes
            s.pending = data[cut:]
            if cut:
                # samples that were waiting in the pipe (idle_since None) came while the agent was busy: the
                # agent's backlog, never a gap; only silence the reader watched can be the writer's
                self._take(s, data[:cut], now, idle_since)
                self._cond.notify_all()
        return True

    def _datagram(self, d: Datagram) -> None:
        data, addr = d.data, d.sender
        seq = None
        if self.sequenced and len(data) >= SEQ_BYTES:
            (seq,) = SEQ.unpack_from(data)
            data = data[SEQ_BYTES:]
        # a numbered datagram of no samples (a heartbeat: the sender had nothing to send) takes its number
        whole = len(data) % self.sample_bytes == 0 and (len(data) > 0 or seq is not None) and (
            seq is not None or not self.sequenced)
        if d.dropped is not None and d.dropped != self._drop_count:
            lost = (d.dropped - self._drop_count) % 2**32
            self._drop_count = d.dropped
            self._overflow(lost, addr, len(data) // self.sample_bytes if whole else 0)
        if not whole:
            self._malformed(d, data)
            return
        s = self._stream_for(addr, d.arrival)
        if s is None:
            return
        # the kernel's arrival time: silence before it is the sender's, whatever the agent was doing
        exact = 0.0 if self.datagrams and self.datagrams.exact else None
        for got, at in (self._sequence(s, seq, data, d.arrival) if seq is not None else [(data, d.arrival)]):
            if got:
                self._take(s, got, at, exact)
        self._shed(s)

    def _malformed(self, d: Datagram, data: bytes) -> None:
        """Counted and dropped. An unnumbered sender's holding a sample's bytes or more: a hole the agent made in
        its stream (its whole samples counted lost, the state not carried across); a numbered one's shows as a
        jump at its next number."""
        self.stats.bad += 1
        head = f"a {SEQ_BYTES}-byte sequence number and " if self.sequenced else ""
        addr = d.sender
        self._bad.append(f"{self.name}: datagram of {len(d.data)} bytes from {addr[0]}:{addr[1]} is not {head}"
                         f"whole samples of {self.sample_bytes} bytes")
        s = self.streams.get(addr)
        lost = len(data) // self.sample_bytes  # fewer bytes than a sample: a stray packet, not the stream's audio
        if not self.sequenced and s is not None and s.received and lost:
            self.lost_samples += lost
            self._hole(s, lost, lost_reason(lost, f"a malformed datagram of {len(d.data)} bytes was dropped"))

    def _end_writer(self, s: Stream, why: str) -> int:
        """The pipe's writer went away: its leftovers dropped; the next writer's first samples are a restart."""
        before = s.session
        left = s.end(why)
        self.dropped_samples += left
        s.restart_due = s.restart_due or s.session > before
        return left

    def _same_fifo(self) -> bool:
        assert self.path is not None and self.fd is not None
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except OSError:
            return False

    def _reopen(self, wait: float) -> bool:
        assert self.path is not None
        if wait:
            time.sleep(wait)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            if self.stats.state != "lost":
                self.stats.losses += 1
                log.warning("source.lost", source=self.name, reason=f"cannot reopen the FIFO: {exc.strerror}")
            self.stats.state, self.stats.last_error = "lost", f"cannot reopen {self.path}: {exc.strerror}"
            return True
        self.stats.reconnects += 1
        self.stats.state = "open"
        return True

    def _window(self, got: tuple[np.ndarray, StreamSpan, Stream]) -> Frame:
        win, span, stream = got
        at, ns = time.time(), time.perf_counter_ns()
        if not np.all(np.isfinite(win)):
            self.stats.bad += 1
            raise BadFrame(f"{span.stream}: window {span.window} with non-finite samples")
        self.stats.frames += 1
        self.stats.last_frame_ns = ns
        return SensorFrame(self.stats.frames, win, at, ns, span, lambda sp, dropped: self._settled(stream, sp, dropped))

    def _settled(self, stream: Stream, span: StreamSpan, dropped: bool) -> None:
        """The pipeline served (or dropped) this window: it and any taken before it leave the backlog; a dropped
        window's own samples count as dropped in its stream and the source."""
        with self._cond:
            if dropped:
                self.dropped_samples += stream.settle_dropped(span)
            else:
                stream.settle(span)

    def read(self, stop: threading.Event) -> Frame | None:
        """The next window of some stream; every source's samples are taken by a thread of its own (UDP's
        receiver, paho's network loop, the pipe's reader), so this only waits for them."""
        while not stop.is_set():
            self.stats.beat()
            with self._cond:
                if self._bad:
                    raise BadFrame(self._bad.popleft())
                got = self._ready()
                if got is None:
                    if self._closing.is_set():
                        break
                    if self._ended.is_set():
                        self.stats.state = "ended"
                        return None
                    self._cond.wait(0.2)
                    continue
                self._cond.notify_all()  # a pipe reader held back by a full buffer reads on
            return self._window(got)
        return None

    def streams_health(self) -> dict[str, Any]:
        """Per-stream names and counters for health (bounded: at most max_streams streams). `behind_s`: how
        far the agent is behind the stream furthest ahead of it (the oldest unserved sample's age)."""
        now = time.time()
        with self._cond:
            in_pipe = self._in_pipe()
            streams = {s.name: s.health(now, in_pipe) for s in self.streams.values()}
            # a sender gone quiet is timed out by stream time, but the windows it sent before are the agent's
            # backlog until served: listed (and in behind_s) while the pipeline still holds some
            streams.update((s.name, s.health(now)) for s in self.quiet.values() if s.in_flight and s.name not in streams)
            out: dict[str, Any] = {
                "max_streams": self.max_streams, "refused_datagrams": self.refused, "restarts": self.restarts,
                "dropped_samples": self.dropped_samples, "lost_samples": self.lost_samples,
                "behind_s": max((h["oldest_unserved_age_s"] for h in streams.values()), default=0.0),
                "streams": streams}
            if self.fd is not None or self.path is not None or isinstance(self.cfg, StdinSourceConfig):
                out.update(held=self.held, holding=self._holding)  # a pipe left unread: its buffer was full
            if self.datagrams is not None:
                out.update(lost_datagrams=self.lost_datagrams, receive_buffer_bytes=self.datagrams.receive_buffer)
            if self.sequenced:
                out[f"lost_{self.unit}"], out[f"late_{self.unit}"] = self.lost_datagrams, self.late_datagrams
            return out

    def _in_pipe(self) -> int:
        """Samples written into the pipe (FIFO, stdin) and not read yet: the agent's backlog there too."""
        return 0 if self._pushed else self._pipe_bytes() // self.sample_bytes

    def _pipe_bytes(self) -> int:
        fd = self.fd
        if fd is None:
            return 0
        try:
            waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:  # a regular file or device without FIONREAD, or closed meanwhile
            return 0
        return max(0, int(waiting))

    def close(self) -> None:
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.sock is not None:
            self.sock.close()
        if self.client is not None:
            self.client.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
            self.client.loop_stop()
        with self._cond:
            if self.fd is not None and not isinstance(self.cfg, StdinSourceConfig):
                os.close(self.fd)
            self.fd = None

