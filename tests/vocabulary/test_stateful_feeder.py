"""The InputFeeder's state per sensor stream (issue 44): a state is carried only from the window just before,
whose outputs were stored; a window that raised or gave non-finite outputs is a hole; a long-lived stream's
state outlives many short streams (least recently used forgotten first)."""

from __future__ import annotations

import numpy as np

from agent.serving.stream_time import StreamSpan
from agent.vocabulary import inputs
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.manifest import ExtraInput


def _feeder() -> InputFeeder:
    return InputFeeder("x", (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))


def _span(k: int, stream: str = "s", session: int = 1) -> StreamSpan:
    return StreamSpan(stream, session, k, k * 256, (k + 1) * 256, 256)


def _step(f: InputFeeder, k: int, stream: str = "s", value: float | None = None) -> np.ndarray:
    h = f.feeds(np.zeros(1), stream, span=_span(k, stream))["h"].copy()
    if value is not None:
        f.advance(stream, {"hn": np.full((1, 4), value, np.float32)})
    return h


def test_windows_that_ran_carry_their_state() -> None:
    f = _feeder()
    assert _step(f, 0, value=1.0).sum() == 0 and f.last_note == "initial"
    assert (_step(f, 1, value=2.0) == 1.0).all() and f.last_note == "carried"
    assert (_step(f, 2, value=3.0) == 2.0).all() and f.last_note == "carried"


def test_a_run_that_raised_resets_the_next_window_even_the_first() -> None:
    f = _feeder()
    _step(f, 0)  # the stream's first window raised: its initial state is not carried across it either
    assert (_step(f, 1, value=5.0) == 0).all() and f.last_note == "reset: window 0 of the stream did not run (an inference error)"
    assert (_step(f, 2) == 5.0).all() and f.last_note == "carried"
    assert (_step(f, 3) == 0).all() and f.last_note == "reset: window 2 of the stream did not run (an inference error)"


def test_a_failed_window_is_a_hole_and_says_why() -> None:
    f = _feeder()
    _step(f, 0, value=1.0)
    _step(f, 1)
    f.failed("s", "window 1 of the stream gave non-finite outputs ['hn']")
    assert (_step(f, 2, value=7.0) == 0).all()
    assert f.last_note == "reset: window 1 of the stream gave non-finite outputs ['hn']"
    assert (_step(f, 3) == 7.0).all() and f.last_note == "carried"


def test_a_failed_step_without_a_span_starts_the_source_again() -> None:
    f = _feeder()
    f.feeds(np.zeros(1), "cam")
    f.advance("cam", {"hn": np.full((1, 4), 3.0, np.float32)})
    f.feeds(np.zeros(1), "cam")
    f.failed("cam", "non-finite")
    assert (f.feeds(np.zeros(1), "cam")["h"] == 0).all()


def test_the_least_recently_used_stream_is_forgotten_not_the_oldest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(inputs, "MAX_TRACKED_SOURCES", 8)
    f = _feeder()
    _step(f, 0, "long", value=1.0)
    for k in range(40):  # short streams come and go (one window each), the long one keeps streaming
        _step(f, 0, f"short{k}", value=1.0)
        if k % 4 == 3:
            _step(f, k // 4 + 1, "long", value=1.0)
            assert f.last_note == "carried", k
    assert len(f._sources) == 8
    _step(f, 0, "short0")  # forgotten long ago: a new stream
    assert f.last_note == "initial"
