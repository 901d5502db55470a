"""A pipe (FIFO) read on its own thread into a bounded buffer: when the buffer is full the pipe is left unread
(the writer blocks), health and the log say so, and nothing is lost or reset (issue 44 point 1).

A frame declared at 100 samples/s makes the buffer's bound (source.max_backlog_s, 60 s: 6,000 samples)
small enough to fill from a real FIFO in a fast test.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

W = 4  # window (= hop)
TOTAL = 40_000  # samples written: more than six times the bound


def test_a_pipe_whose_buffer_is_full_is_left_unread_and_said_and_nothing_is_lost_or_reset(tmp_path: Path) -> None:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 100, "window": W},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    src = SensorSource(SourceConfig(type="file", path=fifo), frame)
    done = threading.Event()

    def writer() -> None:
        with open(fifo, "wb", buffering=0) as f:  # blocks on the full pipe while the reader holds off
            f.write(np.arange(TOTAL, dtype="<f4").tobytes())
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    stop = threading.Event()
    try:
        health = src.streams_health
        # a barrier: the reader filled its buffer and stopped reading; the writer is blocked on the pipe
        assert wait_until(lambda: health()["holding"], 20), health()
        (stream,) = health()["streams"].values()
        assert stream["backlog_samples"] >= src.max_backlog and not done.is_set()
        assert health()["held"] == 1
        frames: list[Any] = []
        while len(frames) < TOTAL // W:
            f = src.read(stop)
            assert f is not None, len(frames)
            frames.append(f)
        assert done.is_set() and health()["held"] >= 1
        spans = [f.span for f in frames]
        assert {s.session for s in spans} == {1} and all(s.reset is None for s in spans)
        got = np.concatenate([f.data[:, 0] for f in frames])
        assert np.array_equal(got, np.arange(TOTAL, dtype=np.float32))  # every sample, in order
        assert health()["lost_samples"] == 0 and health()["restarts"] == 0
    finally:
        stop.set()
        src.close()
