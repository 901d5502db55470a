"""Review of issue 44: a `framing: seq32` UDP sender that restarts (its sequence numbers start again at 0,
from the same address, sooner than `source.stream_timeout_s`) is a new stream, not a flood of late datagrams.

A microcontroller or a feeder bound to a fixed source port that reboots numbers its datagrams from 0
again. Found: every datagram of the restarted sender is taken as "already passed" (late) and dropped
until its numbers catch up with the old ones -- a sender that had sent a million datagrams is silenced
for a million more, with only `late_datagrams` rising; nothing is served and no state says why.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until


def _source() -> Any:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    return SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, framing="seq32"), frame)


def test_a_seq32_sender_that_restarts_its_numbering_is_served_as_a_new_session_not_dropped_as_late() -> None:
    src = _source()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    frames: list[Any] = []

    def read() -> None:
        while (f := src.read(stop)) is not None:
            frames.append(f)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for n in range(100_000, 100_010):  # a sender that has been up a while
            tx.sendto(struct.pack("<I", n) + np.full(256, n, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: len(frames) >= 10, 10), len(frames)
        for n in range(10):  # it reboots: the same address, numbering from 0 again
            tx.sendto(struct.pack("<I", n) + np.full(256, -n, "<f4").tobytes(), ("127.0.0.1", src.port))
        h = src.streams_health
        # a barrier: all ten datagrams of the restarted sender were taken off the socket (served or dropped)
        assert wait_until(lambda: len(frames) + h()["late_datagrams"] >= 20, 10), (len(frames), h())
        after = frames[10:]
        assert [int(f.data[0, 0]) for f in after] == [-n for n in range(10)], (
            f"the restarted sender's datagrams were dropped as late: {h()['late_datagrams']} late_datagrams, "
            f"{len(after)} windows served")
        assert after[0].span.session == 2 and after[0].span.reset
    finally:
        stop.set()
        tx.close()
        src.close()
