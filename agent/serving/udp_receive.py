"""One UDP datagram with what the kernel knows of it: when it arrived, and how many datagrams the socket
dropped before it (its receive buffer was full).

The arrival is the kernel's receive timestamp (SO_TIMESTAMPNS), not the moment the agent read the datagram:
a sender's silence is measured on it, so a backlog in the agent is never taken for a gap. The drop counter
(SO_RXQ_OVFL) is the socket's count of datagrams lost to a full receive buffer, as it stood when this
datagram was queued: a rise between two datagrams is a hole just before the second. Where the platform has
neither (not Linux), the arrival is the read time and drops are not seen (`Datagrams.exact` False).
"""

from __future__ import annotations

import select
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

# Linux's values (asm-generic and every architecture the agent ships for); Python does not name them
SO_TIMESTAMPNS = 35
SO_RXQ_OVFL = 40
SO_MEMINFO = 55  # u32[SK_MEMINFO_VARS]; SK_MEMINFO_DROPS (index 8) is the counter SO_RXQ_OVFL reports
SK_MEMINFO_DROPS = 8
MAX_DATAGRAM = 65536


@dataclass(frozen=True)
class Datagram:
    data: bytes
    sender: Any  # (host, port)
    arrival: float  # wall clock (time.time()'s), when the kernel received it where `exact`
    dropped: int | None  # the socket's drop counter when it was queued; None: not known


class Datagrams:
    """recvmsg on a bound UDP socket, with the kernel's arrival time and drop counter where it has them."""

    def __init__(self, sock: socket.socket, receive_buffer: int = 0):
        self.sock = sock
        if receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.exact = self.counts_drops = False
        if sys.platform.startswith("linux"):
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.exact = True
            except OSError:
                pass
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
                self.counts_drops = True
            except OSError:
                pass
        self._anc = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(4) if (self.exact or self.counts_drops) else 0

    @property
    def receive_buffer(self) -> int:
        return int(self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))

    def drops(self) -> int | None:
        """The socket's drop counter now (None where it is not known): drops after the last datagram queued
        (the end of a burst) ride on no datagram, so they are read here when the socket is quiet."""
        if not self.counts_drops:
            return None
        if select.select([self.sock], [], [], 0)[0]:
            return None  # datagrams still queued: drops came after them (read once the queue is drained)
        try:
            raw = self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
        except OSError:
            return None
        if len(raw) < 4 * (SK_MEMINFO_DROPS + 1):
            return None
        return int(struct.unpack_from("=I", raw, 4 * SK_MEMINFO_DROPS)[0])

    def receive(self) -> Datagram:
        """The next datagram; raises TimeoutError after the socket's time-out."""
        if not self._anc:
            data, addr = self.sock.recvfrom(MAX_DATAGRAM)
            return Datagram(data, addr, time.time(), None)
        data, anc, _flags, addr = self.sock.recvmsg(MAX_DATAGRAM, self._anc)
        # the kernel attaches the drop counter only once it is above 0
        arrival, dropped = None, (0 if self.counts_drops else None)
        for level, kind, payload in anc:
            if level != socket.SOL_SOCKET:
                continue
            if kind == SO_TIMESTAMPNS and len(payload) in (8, 16):
                # struct timespec: two longs (64-bit: 16 bytes; a 32-bit ARM's old time_t: 8)
                sec, ns = struct.unpack("=qq" if len(payload) == 16 else "=ii", payload)
                arrival = sec + ns / 1e9
            elif kind == SO_RXQ_OVFL and len(payload) >= 4:
                (dropped,) = struct.unpack("=I", payload[:4])
        return Datagram(data, addr, arrival if arrival is not None else time.time(), dropped)
