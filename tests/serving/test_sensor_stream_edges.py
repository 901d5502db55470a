"""Edges of sensor streams found by trying to break them (fast lane, no model, real UDP sockets).

- A UDP sender that went quiet for stream_timeout_s and is heard again is a new session of its stream
  (before: it started again as session 1, window 0, so state notes read "-21 windows not served" and an
  open segment of the old stream was carried into the new one).
- A hop longer than the window (a short window every so often) skips the samples between windows; the
  windows' stream time stays exact (before: the skipped samples were served and stamped as later ones).
"""

from __future__ import annotations

import re
import socket
import threading

import numpy as np

from agent.config import SourceConfig
from agent.serving.sensors import SensorSource, _Stream
from agent.vocabulary.decisions import SegmentTracker
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.manifest import DecisionSpec, EventSpec, ExtraInput, PostprocessSpec, frame_from_dict

STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),)


def _source(**kw: object) -> SensorSource:
    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 1000, "window": 100}, STATE)
    return SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, **kw), frame)


def _read(src: SensorSource):  # type: ignore[no-untyped-def]
    frame = src.read(threading.Event())
    assert frame is not None
    return frame


def test_a_sender_heard_again_after_its_stream_timed_out_is_a_new_session() -> None:
    src = _source(stream_timeout_s=0.1)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    feeder = InputFeeder("x", STATE)
    post = PostprocessSpec(type="raw", decision=DecisionSpec(rule="threshold", threshold=0.5),
                           events=EventSpec(label="1"))
    tracker = SegmentTracker(post, 1000.0)
    try:
        spans = []
        for k in range(3):  # three windows of one stream, all deciding 1: a segment is open
            tx.sendto(np.full(100, 1.0, "<f4").tobytes(), ("127.0.0.1", src.port))
            f = _read(src)
            feeder.feeds(np.zeros(1), f.span.stream, span=f.span)
            feeder.advance(f.span.stream, {"hn": np.ones((1, 4), np.float32)})
            assert tracker.update(f.span, {"decision": {"value": 0.9, "label": "1"}}) == []
            spans.append(f.span)
        assert [s.session for s in spans] == [1, 1, 1]
        for _ in range(50):  # a barrier, not a sleep: wait until the source ended the quiet stream
            if not src.streams:
                break
            src._receive()
        assert not src.streams
        tx.sendto(np.full(100, 1.0, "<f4").tobytes(), ("127.0.0.1", src.port))
        f = _read(src)
        assert f.span.stream == spans[0].stream
        assert (f.span.session, f.span.window, f.span.start) == (2, 0, 0)
        assert f.span.reset is not None and "quiet" in f.span.reset
        feeder.feeds(np.zeros(1), f.span.stream, span=f.span)
        assert feeder.last_note is not None and feeder.last_note.startswith("reset: ") and "quiet" in feeder.last_note
        # the old stream's open segment is closed at its own last window, not carried into the new one
        events = tracker.update(f.span, {"decision": {"value": 0.9, "label": "1"}})
        assert [(e["session"], e["start_sample"], e["end_sample"]) for e in events] == [(1, 0, 300)]
    finally:
        tx.close()
        src.close()


def test_a_hop_longer_than_the_window_skips_the_samples_between_windows() -> None:
    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 1000, "window": 100, "hop": 250})
    s = _Stream("s", frame, frame.step)
    got = []
    for k in range(10):  # 1000 samples, numbered, in chunks of 100
        s.push((100.0 * k + np.arange(100, dtype=np.float32))[:, None], arrival=0.1 * k)
        while (w := s.pop()) is not None:
            got.append(w)
    assert [(sp.start, sp.end) for _, sp in got] == [(0, 100), (250, 350), (500, 600), (750, 850)]
    for win, sp in got:  # each window holds exactly the samples its span names
        assert win[0, 0] == sp.start and win[-1, 0] == sp.end - 1


def test_samples_are_read_in_the_bundles_frame_dtype_unless_the_source_says_otherwise() -> None:
    """A bundle whose frame declares int16 samples (16-bit PCM, as `ffmpeg -f s16le` sends) is fed int16
    by a source that leaves sample_dtype out (before: read as float32, two samples made one garbage value)."""
    frame = frame_from_dict({"kind": "sensor", "channels": 1, "dtype": "int16", "sample_rate": 1000, "window": 100})
    pcm = (np.arange(100) * 300 - 15000).astype("<i2")
    for cfg, want in ((SourceConfig(type="udp", host="127.0.0.1", port=0), pcm.astype(np.float32)),
                      (SourceConfig(type="udp", host="127.0.0.1", port=0, sample_dtype="uint8"), None)):
        src = SensorSource(cfg, frame)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            tx.sendto(pcm.tobytes() * 2, ("127.0.0.1", src.port))  # 400 bytes: whole windows either way
            f = _read(src)
            if want is not None:
                assert f.data.shape == (100, 1) and np.array_equal(f.data[:, 0], want)
            else:  # the source's own sample_dtype wins: each byte is a uint8 sample
                assert f.data.shape == (100, 1) and np.array_equal(f.data[:, 0], np.frombuffer(pcm.tobytes(), "u1")[:100])
        finally:
            tx.close()
            src.close()


def test_a_sensor_frame_without_dtype_reads_float32_samples_as_the_schema_says() -> None:
    frame = frame_from_dict({"kind": "sensor", "channels": 1, "window": 100})
    assert frame.dtype == "float32"
    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0), frame)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tx.sendto(np.arange(100, dtype="<f4").tobytes(), ("127.0.0.1", src.port))
        assert np.array_equal(_read(src).data[:, 0], np.arange(100, dtype=np.float32))
    finally:
        tx.close()
        src.close()


def test_a_sender_ahead_of_real_time_is_not_quiet_between_its_datagrams() -> None:
    """stream_timeout_s is measured like gaps, in stream time: a sender whose datagrams each hold 1 s of
    audio, sent every 0.5 s, is never quiet (before: 0.5 s between arrivals > stream_timeout_s 0.3 ended
    its stream at every datagram, and a stateful model started again from init each time)."""
    import time

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 1000, "window": 100}, STATE)
    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, stream_timeout_s=0.3), frame)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for k in range(3):
            tx.sendto(np.arange(1000, dtype="<f4").tobytes(), ("127.0.0.1", src.port))
            end = time.monotonic() + 0.5
            while time.monotonic() < end:  # the source's own loop: receive, expire quiet streams
                src._receive()
        assert [s.session for s in src.streams.values()] == [1] and not src.quiet
    finally:
        tx.close()
        src.close()


def test_a_padding_without_its_amount_or_with_two_is_refused() -> None:
    import pytest

    from agent.errors import BundleError

    base = {"kind": "sensor", "channels": 1, "sample_rate": 1000, "window": 100}
    for pad, found in (({"mode": "zero"}, "neither"), ({"mode": "zero", "samples": 10, "seconds": 0.02},
                                                       "['samples', 'seconds']")):
        with pytest.raises(BundleError, match=r"input\.frame\.padding: give samples or seconds \(one of them\), "
                                              f"found {re.escape(found)}"):
            frame_from_dict({**base, "padding": pad})
