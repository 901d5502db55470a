"""Review of issue 44: a FIFO writer that closes and a new one that opens it is a new stream, behind or not.

docs/sensors.md: on a FIFO "one stream is one writer session: the writer closes (or is killed) and a new
one opens the FIFO" -- a new session, its state from `init`. A writer that closes after 0.77 s of audio
and a new writer 0.1 s later (less than reset_on_gap_s 0.2, so only the writer change can say it) is two
sessions when the agent keeps up. When the agent is behind, the pipe never runs empty between the two
writers, the reader never reads end-of-file, and the second writer's audio is served as the first's
continuation: its state carried from another writer's stream, with no word.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tests.serving.test_sensor_backlog as tsb
from tests.serving.test_sensor_backlog import N, _Served, _stream, bundle, reference  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


@pytest.mark.slow
@pytest.mark.serial  # real time: a writer change against the agent's backlog
@pytest.mark.parametrize("delay_s", [0.0, 0.06], ids=["agent-keeps-up", "agent-behind"])
def test_a_new_fifo_writer_is_a_new_session_even_when_the_agent_is_behind(
        bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:  # noqa: F811
    monkeypatch.setattr(tsb, "DELAY_S", delay_s)  # 60 ms per 8 ms window: 7.5x slower than the stream
    a, b = _stream(21), _stream(22)
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    served = _Served(bundle, type="file", path=fifo).start()

    def writers() -> None:
        with open(fifo, "wb", buffering=0) as f:  # the first writer: its stream, then it exits
            f.write(a.astype("<f4").tobytes())
        time.sleep(0.1)  # a feeder restarted by its supervisor (the stimulus, not a wait)
        with open(fifo, "wb", buffering=0) as f:  # another writer, another stream
            f.write(b.astype("<f4").tobytes())

    t = threading.Thread(target=writers, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(served.results()) >= 2 * N, 90), len(served.results())
        t.join(10)
        spans = [r["result"]["stream"] for r in served.results()]
        resets = [(k, s["state"]) for k, s in enumerate(spans) if s["state"] not in ("initial", "carried")]
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in served.results()[N:2 * N]])
        worst = float(np.abs(got - reference(b)).max())
        assert resets and resets[0][0] == N and spans[N]["session"] == 2, (
            f"the second writer's stream was served as the first's continuation (resets: {resets}); its {N} "
            f"windows differ from its own stream by up to {worst:.3f}")
        assert worst < 1e-4
    finally:
        served.close()
