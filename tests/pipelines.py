"""A serving pipeline run in the test's process to the end of a finite source."""

from __future__ import annotations

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
