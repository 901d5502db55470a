"""Review of issue 44 point 5 (third pass): "When the agent falls behind a real-time stream, health says by how
much (seconds of backlog, oldest unserved sample age), so an operator sees it before answers go stale."

docs/sensors.md: "`behind_s` is the largest `oldest_unserved_age_s` ... A growing `behind_s` is answers going
stale before anything is lost." A writer that paused with part of a window written (a push-to-talk feeder, a
sensor that stops between events) leaves those samples waiting for the rest of their window: nothing for the
agent to serve, it is idle and has served every window. Yet `behind_s` grows with the writer's silence.
"""

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

W = 256


def test_behind_s_does_not_grow_while_the_agent_waits_for_the_rest_of_a_window(tmp_path: Path) -> None:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": W},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=5.0),))
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    src = SensorSource(SourceConfig(type="file", path=fifo), frame)
    stop = threading.Event()
    frames: list[Any] = []

    def read() -> None:
        while (f := src.read(stop)) is not None:
            f.settled()  # served, as the pipeline's publish stage says
            frames.append(f)

    threading.Thread(target=read, daemon=True).start()
    f = open(fifo, "wb", buffering=0)
    try:
        f.write(np.zeros(3 * W + W // 2, "<f4").tobytes())  # 3.5 windows, then the writer is silent (pipe open)
        assert wait_until(lambda: len(frames) >= 3, 10), len(frames)
        time.sleep(3.0)  # the writer's silence (the stimulus)
        h = src.streams_health()
        (st,) = h["streams"].values()
        assert h["behind_s"] < 0.5, (
            f"3 windows served, the agent idle, the writer silent for 3 s: behind_s {h['behind_s']}, "
            f"backlog_samples {st['backlog_samples']}, oldest_unserved_age_s {st['oldest_unserved_age_s']}")
    finally:
        stop.set()
        f.close()
        src.close()
