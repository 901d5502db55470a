"""Stream time without a model (fast lane): windows, hops and padding in samples or seconds, gaps measured
against the audio a stream already sent, stream restarts that drop leftovers, segments closed by a restart.
"""

from __future__ import annotations

import numpy as np
import pytest

from agent.errors import BundleError
from agent.serving.sensors import StreamSpan, _Stream
from agent.vocabulary.manifest import ExtraInput, FrameSpec, frame_from_dict

STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=0.3),)


def _frame(**kw: object) -> FrameSpec:
    base = {"kind": "sensor", "channels": 1, "dtype": "float32", "sample_rate": 1000, "window": 100, "hop": 50}
    return frame_from_dict({**base, **kw}, STATE)


def test_windows_hops_and_padding_in_seconds_become_samples() -> None:
    f = frame_from_dict({"kind": "sensor", "channels": 2, "sample_rate": 16000, "window_s": 0.036, "hop_s": 0.032,
                         "padding": {"mode": "zero", "seconds": 0.004}}, STATE)
    assert (f.window, f.hop, f.pad, f.padding) == (576, 512, 64, "zero")
    assert f.reset_on_gap_s == 0.3 and f.stateful
    with pytest.raises(BundleError, match="window_s: 0.0361 s at 16000 samples/s is 577.6 samples"):
        frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window_s": 0.0361})
    with pytest.raises(BundleError, match="window_s: a time in seconds needs frame.sample_rate"):
        frame_from_dict({"kind": "sensor", "channels": 1, "window_s": 1.0})


def _chunk(n: int, start: float = 0.0) -> np.ndarray:
    return (start + np.arange(n, dtype=np.float32))[:, None]


def test_bursts_in_real_time_are_no_gap_but_silence_beyond_the_sent_audio_is() -> None:
    s = _Stream("s", _frame(), 50)
    # 0.4 s of samples every 0.4 s (real time): 0.4 s between arrivals, over reset_on_gap_s 0.3, yet no gap
    for k in range(5):
        assert s.push(_chunk(400, 400 * k), arrival=100.0 + 0.4 * k) is None
    while s.pop() is not None:
        pass
    assert s.session == 1
    # then 1 s with nothing: the next samples arrive 1 s after the sent audio ran out
    dropped = s.push(_chunk(400), arrival=100.0 + 0.4 * 5 + 1.0)
    assert s.session == 2 and dropped == 0  # hop 50 into 2000 samples: every sample was served
    win, span = s.pop()
    assert span.session == 2 and span.window == 0 and span.start == 0 and "gap of 1.000 s" in span.reset
    assert win[0, 0] == 0.0  # the new stream's own first sample, nothing of the old one


def test_a_gap_drops_the_samples_no_window_served() -> None:
    s = _Stream("s", _frame(), 50)
    s.push(_chunk(230), arrival=10.0)
    spans = []
    while (got := s.pop()) is not None:
        spans.append(got[1])
    assert [(sp.start, sp.end) for sp in spans] == [(0, 100), (50, 150), (100, 200)]
    assert s.push(_chunk(100), arrival=10.23 + 0.5) == 30  # samples 200..229 never served


def test_a_burst_faster_than_real_time_is_no_gap_however_long_the_pause_after_it() -> None:
    s = _Stream("s", _frame(), 50)
    s.push(_chunk(3000), arrival=0.0)  # 3 s of audio at once
    assert s.push(_chunk(100), arrival=2.5) is None  # 2.5 s later: still inside the audio already sent
    assert s.session == 1


def test_without_a_sample_rate_only_arrivals_can_be_compared() -> None:
    s = _Stream("s", frame_from_dict({"kind": "sensor", "channels": 1, "window": 100}, STATE), 100)
    s.push(_chunk(100), arrival=0.0)
    assert s.push(_chunk(100), arrival=0.2) is None
    assert s.push(_chunk(100), arrival=0.6) is not None and s.session == 2


def test_replicate_padding_copies_the_first_sample() -> None:
    s = _Stream("s", _frame(padding={"mode": "replicate", "samples": 40}), 50)
    s.push(_chunk(60, 7.0), arrival=0.0)
    win, span = s.pop()
    assert span.start == -40 and span.end == 60
    assert np.all(win[:40, 0] == 7.0) and win[40, 0] == 7.0 and win[41, 0] == 8.0


def test_a_stream_restart_closes_its_open_segment_at_its_last_window() -> None:
    from agent.vocabulary.decisions import tracker_for
    from agent.vocabulary.manifest import postprocess_from_dict

    post = postprocess_from_dict({"type": "raw", "decision": {"rule": "threshold", "labels": ["no", "yes"]},
                                  "events": {"label": "yes", "min_duration_s": 0.05, "hangover_s": 0.1}})
    t = tracker_for(post, 1000)
    assert t is not None

    def step(session: int, w: int, p: float) -> list:
        span = StreamSpan("s", session, w, w * 50 - 50, w * 50 + 50, 50, 1000.0)
        return t.update(span, {"decision": {"value": p, "label": "yes" if p >= 0.5 else "no"}})

    assert step(1, 0, 0.1) == [] and step(1, 1, 0.9) == [] and step(1, 2, 0.9) == [] and step(1, 3, 0.2) == []
    assert step(1, 4, 0.2) == []  # 50 samples of silence: under the 0.1 s hangover
    ended = step(1, 5, 0.2)  # 100 samples of silence: the segment ends where the silence began
    assert [(e["start_sample"], e["end_sample"]) for e in ended] == [(50, 150)]
    assert step(1, 6, 0.9) == [] and step(1, 7, 0.9) == []
    closed = step(2, 0, 0.1)  # the stream restarted: its open segment ends at its last window's end
    assert [(e["session"], e["start_sample"], e["end_sample"]) for e in closed] == [(1, 300, 400)]


def test_a_fifo_removed_between_writers_is_lost_not_ended_and_serves_again_when_it_returns(tmp_path: object) -> None:
    import os
    import threading
    from pathlib import Path

    from agent.config import SourceConfig
    from agent.serving.sources import open_source
    from waiting import wait_until

    fifo = Path(str(tmp_path)) / "s.fifo"
    os.mkfifo(fifo)
    src = open_source(SourceConfig(type="file", path=fifo), FrameSpec(kind="sensor", window=4, channels=1, dtype="float32"))
    stop, frames, ended = threading.Event(), [], threading.Event()

    def reader() -> None:
        while not stop.is_set():
            f = src.read(stop)
            if f is None:
                break
            frames.append(f)
        ended.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        with open(fifo, "wb") as w:
            w.write(np.arange(8, dtype="<f4").tobytes())
        assert wait_until(lambda: len(frames) == 2, 10)
        os.unlink(fifo)  # the writer went away and the FIFO with it
        assert wait_until(lambda: src.stats.state == "lost", 10), src.stats.state
        assert not ended.is_set()
        os.mkfifo(fifo)
        assert wait_until(lambda: src.stats.state == "open", 10)
        with open(fifo, "wb") as w:
            w.write(np.arange(4, dtype="<f4").tobytes())
        assert wait_until(lambda: len(frames) == 3, 10)
        assert frames[2].span.session == 2 and frames[2].span.window == 0
    finally:
        stop.set()
        t.join(5)
        src.close()


def test_a_hole_serves_the_windows_before_it_and_the_backlog_counts_every_sample_until_served() -> None:
    """Issue 44: a hole (datagrams lost) starts a new session after the windows the old one can still fill;
    the backlog (health's backlog_s, oldest_unserved_age_s) counts each sample until a window serves it."""
    s = _Stream("s", _frame(), 50)
    s.push(_chunk(330), arrival=10.0)
    s.push(_chunk(100, 330), arrival=10.5)
    assert s.backlog == 430 and s.oldest_unserved() == 10.0
    s.hole(200, "200 samples lost (2 datagrams missing)")
    assert (s.backlog, s.dropped_samples, s.lost_samples) == (400, 30, 200)  # 30 under a window: dropped
    spans, oldest = [], []
    while (got := s.pop()) is not None:
        spans.append(got[1])
        s.settle(got[1])  # served: the pipeline is done with it
        oldest.append(s.oldest_unserved())
    assert [(sp.session, sp.start) for sp in spans] == [(1, k * 50) for k in range(7)]
    assert oldest == [10.0] * 5 + [10.5, None] and s.backlog == 0
    s.push(_chunk(100, 1000.0), arrival=10.6)
    win, span = s.pop()
    assert (span.session, span.window, span.start, span.reset) == (2, 0, 0, "200 samples lost (2 datagrams missing)")
    assert win[0, 0] == 1000.0


def test_samples_that_waited_in_a_pipe_are_no_gap_however_late_they_are_read() -> None:
    """Issue 44: the agent's own backlog was taken for the writer's silence (a reset every pipe buffer)."""
    s = _Stream("s", _frame(), 50)
    s.push(_chunk(100), arrival=0.0, idle_since=0.0)
    assert s.push(_chunk(100, 100), arrival=5.0, idle_since=None) is None  # waiting in the pipe when read
    assert s.push(_chunk(100, 200), arrival=9.0, idle_since=8.9) is None  # watched empty for 0.1 s only
    assert s.session == 1
    assert s.push(_chunk(100, 300), arrival=20.0, idle_since=9.0) == 0 and s.session == 2  # watched 11 s


def test_a_window_taken_and_not_yet_served_stays_in_the_backlog_until_settled() -> None:
    """Issue 44 (review 44c): backlog_samples is 'delivered and not yet served'. A window the pipeline took
    (in its queues, in flight) is still the agent's backlog; settling one settles every window taken before it
    (one the pipeline dropped without a word leaves with the next)."""
    s = _Stream("s", _frame(), 50)
    s.push(_chunk(220), arrival=10.0)  # windows of 100 every 50: [0, 100), [50, 150), [100, 200); 20 wait
    spans = [s.pop()[1] for _ in range(3)]  # type: ignore[index]
    assert (s.backlog, s.in_flight, s.oldest_unserved()) == (20, 200, 10.0)
    s.settle(spans[1])  # the second published; the first was dropped without settling
    assert (s.backlog, s.in_flight) == (20, 50)
    s.settle(spans[2])
    assert (s.backlog, s.in_flight) == (20, 0)
