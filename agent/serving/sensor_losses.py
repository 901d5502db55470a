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
from agent.serving.udp_receive import Datagram, Datagrams
from agent.spec.manifest import FrameSpec

log = get_logger("source")

SEQ = struct.Struct("<I")  # source.framing seq32: each datagram starts with its sender's sequence number
SEQ_BYTES = SEQ.size
# a sequenced datagram at most this many behind the expected one is late (reordered, duplicated) and dropped;
# further behind, its sender restarted its numbering (a reboot from the same address): a new session
SEQ_REORDER = 64


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
    _bad: deque[str]
    _take: Callable[..., None]
    _shed: Callable[[Stream], None]

    def _overflow(self, lost: int, d: Datagram, samples: int) -> None:
        """The socket dropped `lost` datagrams just before `d`: a hole in the stream they belonged to. One
        stream: its own, each of its largest datagram's size (or `d`'s). Several: whose cannot be told, so each
        starts again."""
        if not self.sequenced:  # sequenced: counted per stream where its sequence jumps
            self.lost_datagrams += lost
        own = self.streams.get(d.sender)
        others = [s for a, s in self.streams.items() if a != d.sender and s.received]
        why = f"{lost} datagrams dropped by the socket: its receive buffer was full"
        if self.sequenced:
            pass  # each sender's sequence numbers find its own hole (and count its samples): see _sequence
        elif not others:  # one sender: the hole is its own (before its first datagram: not counted as its)
            samples = max(samples, own.largest if own is not None else 0)  # a short datagram after: its last
            self.lost_samples += lost * samples
            if own is not None and own.received:
                self.dropped_samples += own.hole(lost * samples, lost_reason(lost * samples, why))
                self.restarts += 1
        else:
            for s in [*others, *([own] if own is not None else [])]:
                self.dropped_samples += s.hole(0, f"{why}, from any of {len(others) + (own is not None)} senders")
            self.restarts += 1
        log.warning("source.datagrams_lost", source=self.name, lost_datagrams=lost, total=self.lost_datagrams,
                    receive_buffer_bytes=self.datagrams.receive_buffer if self.datagrams else None,
                    fix="raise source.receive_buffer_bytes, or give the agent more CPU")

    def _sequence(self, s: Stream, seq: int, samples: int) -> bool:
        """A sender's sequence number: a jump ahead is datagrams lost (a hole, counted exactly for datagrams of
        this one's size); one already passed is late or a duplicate (counted, dropped: its place was taken).
        False: drop this datagram."""
        expect, s.next_seq = s.next_seq, (seq + 1) % 2**32
        if expect is None or seq == expect:
            return True
        ahead = (seq - expect) % 2**32
        behind = (expect - seq) % 2**32
        if ahead >= 2**31 and behind > SEQ_REORDER:
            # far behind: not a late datagram (reordering is a few datagrams) but a sender that restarted its
            # numbering from the same address (a reboot sooner than stream_timeout_s): a new session, said
            self.restarts += 1
            self.dropped_samples += s.end(f"sender restarted its sequence numbers ({seq} after {expect - 1})")
            log.info("source.stream_restarted", source=self.name, stream=s.name,
                     reason="sequence numbers started again", sequence=seq, expected=expect)
            return True
        if ahead >= 2**31:  # behind what was already taken
            s.next_seq = expect
            s.late_datagrams += 1
            self.late_datagrams += 1
            return False
        lost = ahead * samples
        self.lost_samples += lost
        self.lost_datagrams += ahead
        self.restarts += 1
        self.dropped_samples += s.hole(lost, lost_reason(lost, f"{ahead} {self.unit} missing: sequence {expect} to "
                                                               f"{(seq - 1) % 2**32}"))
        log.warning(f"source.{self.unit}_lost", source=self.name, stream=s.name, **{f"lost_{self.unit}": ahead},
                    lost_samples=lost, detail="a gap in the sender's sequence numbers")
        return True
