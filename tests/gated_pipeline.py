"""The real pipeline serving a real bundle whose inference is held at a gate (the engine's
`watch` hook, as tests/serving/test_sensor_backlog.py's _Delay), so a test decides which windows are in flight."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from agent.config import PipelineConfig, SourceConfig


class Gate:
    """Every inference waits at the gate until it opens; `entered` counts the runs that reached it."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0
        self.reached = threading.Event()

    def before(self) -> None:
        with self._lock:
            self.entered += 1
        self.reached.set()
        self.open.wait(60)

    def after(self, outputs: Any) -> Any:
        return outputs

    def abandon(self) -> None:
        pass


class Gated:
    """One preprocessing worker, which runs the model too (the CPU provider's fused layout): a frame waiting in
    the hand-over stays there while the run is held by `gate`."""

    def __init__(self, bundle: Path, gate: Gate, pipeline: dict[str, Any] | None = None, **source: Any):
        from agent.bundle.load import load_bundle
        from agent.serving.pipeline import Pipeline
        from agent.serving.sources import is_lossless, open_source
        from agent.testing import ListSink

        self.gate = gate
        b = load_bundle(bundle)
        self.engine = self.make_engine(bundle, gate)
        cfg = SourceConfig(**source)
        self.source = open_source(cfg, b.manifest.frame)
        self.sink = ListSink()
        pcfg = PipelineConfig(**{"preprocess_workers": 1, "max_batch": 1, **(pipeline or {})})
        self.pipeline = Pipeline(self.source, self.engine, self.sink, pcfg, is_lossless(cfg, self.source))

    @staticmethod
    def make_engine(bundle: Path, gate: Gate | None) -> Any:
        from agent.bundle.load import load_bundle
        from agent.proof.terms import CPU, SessionSettings
        from agent.proof.verdict import Candidate
        from agent.serving.engine import build_engine

        engine = build_engine(load_bundle(bundle), Candidate(CPU, "fp32", "fp32"), SessionSettings(intra_op_threads=1))
        return dataclasses.replace(engine, watch=gate) if gate is not None else engine

    def start(self) -> "Gated":
        self.pipeline.start()
        return self

    def results(self) -> list[dict[str, Any]]:
        return list(self.sink.results)

    def streams(self) -> dict[str, Any]:
        return self.source.streams_health()["streams"]  # type: ignore[attr-defined]

    def close(self) -> None:
        self.gate.open.set()
        self.pipeline.stop()
        self.pipeline.join(timeout=15)
        self.source.close()
