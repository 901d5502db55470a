"""A serving pipeline run in the test's process to the end of a finite source; a source read on its own."""

from __future__ import annotations

import threading
from typing import Any

from agent.config import PipelineConfig
from agent.serving.pipeline import Pipeline


def run_to_end(source: Any, engine: Any, sink: Any, cfg: PipelineConfig, lossless: bool, timeout: float = 30) -> Pipeline:
    """Start a Pipeline, wait (bounded) until the source is done, stop and join it, close the source."""
    p = Pipeline(source, engine, sink, cfg, lossless).start()
    assert p.done.wait(timeout), f"the source was not done within {timeout:g} s"
    p.stop()
    assert p.join(timeout=15)
    source.close()
    return p


def read_frames(source: Any, n: int = 100, timeout: float = 60.0) -> list:
    """Up to `n` frames from `source` (fewer where it ends; bounded by `timeout`), then the source closed."""
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    frames = []
    try:
        while len(frames) < n and (f := source.read(stop)) is not None:
            frames.append(f)
    finally:
        timer.cancel()
        source.close()
    return frames
