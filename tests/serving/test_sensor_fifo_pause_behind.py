"""Review of issue 44: a FIFO writer's real pause must reset the state whether or not the agent is behind.

Issue 44 asks that a stream served by a slow agent gives the results of the same stream served in real
time, every window. A writer that writes 0.77 s of audio, falls silent for 1.5 s (> the bundle's
reset_on_gap_s 0.2) and writes again is two sessions when the agent keeps up. When the agent is behind
by more than the pause (its backlog: what waits in the pipe and its buffer, about 4 s here), the reader
never finds the pipe empty, so the pause is never "watched": the state is carried across the writer's
silence and every window after it is served differently from real time, with no word.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tests.serving.test_sensor_backlog as tsb
from tests.serving.test_sensor_backlog import N, W, _Served, _stream, bundle, reference  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


@pytest.mark.slow
@pytest.mark.serial  # real time: a writer's pause against the agent's backlog
@pytest.mark.parametrize("delay_s", [0.0, 0.06], ids=["agent-keeps-up", "agent-behind"])
def test_a_fifo_writers_pause_resets_the_state_as_in_real_time_even_when_the_agent_is_behind(
        bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:  # noqa: F811
    monkeypatch.setattr(tsb, "DELAY_S", delay_s)  # 60 ms per 8 ms window: 7.5x slower than the stream
    a, b = _stream(11), _stream(12)
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    served = _Served(bundle, type="file", path=fifo).start()

    def writer() -> None:
        with open(fifo, "wb", buffering=0) as f:
            f.write(a.astype("<f4").tobytes())  # 0.77 s of audio at once (blocked by the full pipe)
            time.sleep(1.5)  # the writer's own silence: 1.5 s > reset_on_gap_s 0.2 (the stimulus, not a wait)
            f.write(b.astype("<f4").tobytes())

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(served.results()) >= 2 * N, 90), len(served.results())
        t.join(10)
        spans = [r["result"]["stream"] for r in served.results()]
        resets = [(k, s["state"]) for k, s in enumerate(spans) if s["state"] not in ("initial", "carried")]
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in served.results()[N:2 * N]])
        worst = float(np.abs(got - reference(b)).max())
        assert resets and resets[0][0] == N and resets[0][1].startswith("reset: gap of"), (
            f"the writer's 1.5 s pause was not a reset (resets: {resets}); the {N} windows after it differ "
            f"from the stream served in real time by up to {worst:.3f}")
        assert worst < 1e-4
    finally:
        served.close()
