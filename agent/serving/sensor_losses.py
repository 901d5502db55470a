"""What a sensor source counts as lost, and where its streams start again for it: datagrams the socket dropped
(its drop counter), and the sender's own sequence numbers (`framing: seq32`: a jump ahead is a hole of exactly
the missing datagrams; a number already passed is late, or a sender that restarted its numbering). Mixed into
SensorSource (agent/serving/sensors.py), whose lock is held by every caller."""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict, deque
from typing import Any, Callable


from agent.logsetup import get_logger
from agent.serving.stream_time import Stream, lost_reason
from agent.serving.udp_receive import Datagrams
from agent.vocabulary.manifest import FrameSpec

log = get_logger("source")

SEQ = struct.Struct("<I")  # source.framing seq32: each datagram starts with its sender's sequence number
SEQ_BYTES = SEQ.size


class LossCounting:
    """The source's loss counters and the rules that start a stream's next session at a hole."""

    name: str
    frame: FrameSpec
    sequenced: bool
    sample_bytes: int
    unit: str
    streams: OrderedDict[Any, Stream]
    datagrams: Datagrams | None
    lost_datagrams: int
    lost_samples: int
    dropped_samples: int
    restarts: int
    late_datagrams: int
    _cond: threading.Condition
    _drop_count: int
    _bad: deque[str]
    _take: Callable[..., None]
    _shed: Callable[[Stream], None]

    def _hole(self, s: Stream, lost: int, why: str) -> None:
        """A hole in `s` (`lost` samples known lost, counted in the stream): a restart counted where a session
        ended at it (a session with no sample yet only takes the newer reason: one hole, one restart)."""
        before = s.session
        self.dropped_samples += s.hole(lost, why)
        self.restarts += s.session > before

    def _end(self, s: Stream, why: str) -> int:
        """`s` ended (a writer restarted, a sender restarted its numbering): its leftovers dropped; a restart
        counted where a session with samples ended. Returns the leftovers."""
        before = s.session
        left = s.end(why)
        self.dropped_samples += left
        self.restarts += s.session > before
        return left

    def _overflow(self, lost: int, sender: Any, samples: int) -> None:
        """The socket dropped `lost` datagrams just before one of `sender` (None: the socket went quiet after
        them): a hole in the stream they belonged to. One stream: its own, each of its largest datagram's size
        (or this one's). Several: whose cannot be told, so each starts again."""
        live = [(a, s) for a, s in self.streams.items() if s.received]
        if sender is None and len(live) == 1:
            sender = live[0][0]
        own = self.streams.get(sender)
        others = [s for a, s in live if a != sender]
        why = f"{lost} datagrams dropped by the socket: its receive buffer was full"
        if self.sequenced:
            if sender is not None and own is not None and not others and own.received and samples == 0:
                # the end of a burst, the sender's next numbers: counted here, and taken so its next datagram
                # does not count them again
                samples = lost * own.largest
                if own.next_seq is not None:
                    own.next_seq = (own.next_seq + lost) % 2**32
                self.lost_datagrams += lost
                self.lost_samples += samples
                self._hole(own, samples, lost_reason(samples, f"{why}, after the sender's last datagram"))
            # else each sender's sequence numbers find its own hole (and count its samples): see _sequence
        elif not others:  # one sender: the hole is its own (before its first datagram: not counted as its)
            self.lost_datagrams += lost
            samples = max(samples, own.largest if own is not None else 0)  # a short datagram after: its last
            self.lost_samples += lost * samples
            if own is not None and own.received:
                self._hole(own, lost * samples, lost_reason(lost * samples, why))
        else:
            self.lost_datagrams += lost
            for s in [*others, *([own] if own is not None else [])]:
                self.dropped_samples += s.hole(0, f"{why}, from any of {len(others) + (own is not None)} senders")
            self.restarts += 1
        log.warning("source.datagrams_lost", source=self.name, lost_datagrams=lost, total=self.lost_datagrams,
                    receive_buffer_bytes=self.datagrams.receive_buffer if self.datagrams else None,
                    fix="raise source.receive_buffer_bytes, or give the agent more CPU")

    def _quiet_drops(self) -> None:
        """The socket was quiet: datagrams it dropped after the last one read (the end of a burst) ride on no
        later datagram, so its drop counter is read now (each is counted once: the counter is taken)."""
        now = self.datagrams.drops() if self.datagrams is not None else None
        if now is None or now == self._drop_count:
            return
        lost = (now - self._drop_count) % 2**32
        self._drop_count = now
        self._overflow(lost, None, 0)

    def _late(self, s: Stream) -> None:
        """A number held back (see _sequence) not followed by its successor: it was late or a duplicate."""
        if s.held_back is not None:
            s.held_back = None
            s.late_datagrams += 1
            self.late_datagrams += 1

    def _sequence(self, s: Stream, seq: int, data: bytes, arrival: float) -> list[tuple[bytes, float]]:
        """A sender's sequence number: what to take, in order. A jump ahead is datagrams lost (a hole, counted
        exactly for datagrams of this one's size, or its largest's for a numbered datagram of no samples). A
        number already passed is late or a duplicate (counted, dropped: its place was taken) -- unless the
        next one follows it: then the sender restarted its numbering (a reboot sooner than stream_timeout_s,
        however soon after it started), and both are the first of a new session. A number counted lost at the
        last hole is late whatever follows (reordered)."""
        expect = s.next_seq
        if expect is None or seq == expect:
            self._late(s)
            s.next_seq = (seq + 1) % 2**32
            return [(data, arrival)]
        ahead = (seq - expect) % 2**32
        if ahead >= 2**31:  # behind what was already taken
            held = s.held_back
            if held is not None and seq == (held[0] + 1) % 2**32:
                s.held_back, s.lost_range = None, None
                self._end(s, f"sender restarted its sequence numbers ({held[0]} after {(expect - 1) % 2**32})")
                log.info("source.stream_restarted", source=self.name, stream=s.name,
                         reason="sequence numbers started again", sequence=held[0], expected=expect)
                s.next_seq = (seq + 1) % 2**32
                return [(held[1], held[2]), (data, arrival)]
            self._late(s)
            gone = s.lost_range
            s.held_back = (seq, data, arrival)
            if gone is not None and (seq - gone[0]) % 2**32 < gone[1]:
                self._late(s)  # counted lost at the last hole: reordered, come late
            return []
        self._late(s)
        lost = ahead * (len(data) // self.sample_bytes or s.largest)
        s.next_seq, s.lost_range = (seq + 1) % 2**32, (expect, ahead)
        self.lost_samples += lost
        self.lost_datagrams += ahead
        self._hole(s, lost, lost_reason(lost, f"{ahead} {self.unit} missing: sequence {expect} to {(seq - 1) % 2**32}"))
        log.warning(f"source.{self.unit}_lost", source=self.name, stream=s.name, **{f"lost_{self.unit}": ahead},
                    lost_samples=lost, detail="a gap in the sender's sequence numbers")
        return [(data, arrival)]
