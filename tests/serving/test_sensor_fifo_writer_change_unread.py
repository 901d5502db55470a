"""Review of issue 44 (44r): a FIFO writer change the reader cannot see because backpressure left the pipe unread.

Issue 44 (1): "backpressure slows reading and never resets state" -- nor carries it across two streams.
docs/sensors.md: on a FIFO "one stream is one writer session: the writer closes (or is killed) and a new one
opens the FIFO"; the pipe is read "as the writer writes ... a writer that closes (end-of-file) [is] seen when
it happens, however far the agent is behind"; when the buffer is full "the pipe is left unread and the writer
blocks on it (backpressure: nothing lost, the state never reset) ... a pause of the writer's while the pipe is
left unread cannot be seen". Not a pause here: writer A writes its stream and exits while the reader holds
(its buffer full, source.max_backlog_s); 0.5 s later writer B (a feeder restarted by its supervisor) opens the
FIFO and writes its own stream. The reader never reads end-of-file (when it reads again a writer is there), so
B's samples are served as A's continuation: session 1, no reset, the state carried from another writer's
stream with no word. A pipe without writers is visible without reading it (poll's POLLHUP), and the docs name
only the case of a writer opening *before* the previous one closed as unsupported."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

W = 4  # window (= hop)
A, B = 8000, 400  # samples of writer A (more than the 6,000 the buffer holds at 100 samples/s) and writer B


def test_a_writer_change_while_the_pipe_is_left_unread_is_a_new_session(tmp_path: Path) -> None:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 100, "window": W},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    src = SensorSource(SourceConfig(type="file", path=fifo), frame)

    def write(samples: np.ndarray) -> threading.Thread:
        def run() -> None:
            with open(fifo, "wb", buffering=0) as f:
                f.write(samples.astype("<f4").tobytes())

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    stop = threading.Event()
    try:
        health = src.streams_health
        a = write(np.arange(A, dtype=np.float32))
        a.join(20)
        assert not a.is_alive()  # writer A wrote its stream and exited
        assert wait_until(lambda: health()["holding"], 20), health()  # the reader holds: its buffer is full
        time.sleep(0.5)  # the stimulus: no writer for 0.5 s (a feeder restarted by its supervisor)
        b = write(np.full(B, -1.0, np.float32))  # writer B: another stream
        frames: list[Any] = []
        while len(frames) < (A + B) // W:
            f = src.read(stop)
            assert f is not None, len(frames)
            f.settled()
            frames.append(f)
        b.join(10)
        first_b = next(f.span for f in frames if f.data[0, 0] == -1.0)
        assert first_b.session == 2 and first_b.reset is not None and first_b.start == 0, (
            f"writer B's first window: {first_b} (restarts {health()['restarts']}, held {health()['held']})")
    finally:
        stop.set()
        src.close()
