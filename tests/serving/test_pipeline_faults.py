"""Faults found reviewing stage sizing and the fused workers: each test failed on the code before its fix.

Real parts: the demo classifier in a real ORT session, MJPEG videos written by cv2.VideoWriter.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.config import PipelineConfig, SourceConfig
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import Engine, build_engine
from agent.serving.pipeline import Pipeline
from agent.serving.sources import is_lossless, open_source
from agent.testing import ListSink

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def _mjpeg(path: Path, n: int, h: int = 240, w: int = 320) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 30, (w, h))
    assert writer.isOpened()
    for i in range(n):
        img = np.full((h, w, 3), 40, np.uint8)
        cv2.putText(img, str(i % 10), (w // 3, 2 * h // 3), cv2.FONT_HERSHEY_SIMPLEX, h / 60, (255, 255, 255), h // 30)
        writer.write(img)
    writer.release()
    return path


def _engine() -> Engine:
    b = load_bundle(DEMO)
    variant = b.manifest.variants[0]
    return build_engine(b, Candidate("CPUExecutionProvider", variant.name, variant.precision), SessionSettings())


def _pipeline(video: Path, cfg: PipelineConfig, sink: Any, engine: Engine | None = None) -> Pipeline:
    engine = engine or _engine()
    scfg = SourceConfig(type="video", path=video)
    source = open_source(scfg, engine.bundle.manifest.frame, engine.bundle.manifest.preprocess.resize)
    assert is_lossless(scfg, source)
    return Pipeline(source, engine, sink, cfg, True)


class _SlowSinkThatBreaks(ListSink):
    """A sink slower than the workers (the results queue fills), whose write then fails."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def write(self, result: dict[str, Any]) -> None:
        time.sleep(0.02)
        if len(self.results) + 1 >= self.fail_at:
            raise OSError("disk full")
        super().write(result)


def test_a_sink_that_fails_behind_a_full_results_queue_ends_every_thread(tmp_path: Path) -> None:
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 200), PipelineConfig(), _SlowSinkThatBreaks(20))
    p.start()
    try:
        assert p.done.wait(30)
        assert p.join(timeout=20), f"threads left: {[t.name for t in p._threads if t.is_alive()]}"
        assert p.failed is not None and "OSError" in p.failed
    finally:
        p.stop()
        p.source.close()


class _BrokenPreprocessor:
    """A preprocessing bug (not a PreprocessError): every frame raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fixed_size = inner.fixed_size

    def __call__(self, data: Any) -> Any:
        raise RuntimeError("preprocessor bug")

    def geometry(self, data: Any) -> Any:
        return self.inner.geometry(data)

    def with_geometry(self, data: Any) -> Any:  # what the pipeline calls (a pre graph runs once per frame)
        return self(data), self.geometry(data)


def test_a_preprocessor_bug_in_every_worker_ends_every_thread(tmp_path: Path) -> None:
    engine = _engine()
    broken = dataclasses.replace(engine, preprocessor=_BrokenPreprocessor(engine.preprocessor))
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 200), PipelineConfig(preprocess_workers=2), ListSink(), broken)
    p.start()
    try:
        assert p.join(timeout=20), f"threads left: {[t.name for t in p._threads if t.is_alive()]}"
        assert p.failed is not None and "preprocessor bug" in p.failed and p.done.is_set()
    finally:
        p.stop()
        p.source.close()


def test_a_result_too_large_is_counted_in_drops(tmp_path: Path) -> None:
    n = 12
    sink = ListSink()
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", n), PipelineConfig(), sink)
    p.max_result_bytes = 8  # no result fits
    p.start()
    try:
        assert p.done.wait(30) and p.join(timeout=15)
        assert p.failed is None and not sink.results and p.metrics.result_errors == n
        assert p.metrics.frames_in == n
        assert sum(p.drops.values()) == n and p.drops.get("result_too_large") == n, p.drops
    finally:
        p.source.close()


class _OrderedEngine(Engine):
    """Stands in for a stateful bundle (one frame at a time, in order): records the frames it runs and any
    two runs that overlap."""

    @property
    def max_workers(self) -> int | None:
        return 1

    @property
    def dynamic_batch(self) -> bool:
        return False

    def run(self, tensor: np.ndarray, source: str = "", at: float | None = None, metadata: Any = None,
            frame: Any = None) -> Any:
        log = self.__dict__.setdefault("_log", {"order": [], "running": 0, "overlaps": 0, "batches": []})
        log["batches"].append(tensor.shape[0])
        log["running"] += 1
        if log["running"] > 1:
            log["overlaps"] += 1
        log["order"].append(at)
        time.sleep(0.02)  # slower than a frame comes: a second worker would start the next one meanwhile
        log["running"] -= 1
        return super().run(tensor, source, at, metadata, frame)


@pytest.mark.parametrize("layout", ["fused", "pools"])
def test_after_a_swap_to_a_stateful_engine_frames_run_one_at_a_time_in_order(tmp_path: Path, layout: str) -> None:
    stateless = _engine()
    stateful = _OrderedEngine(**{f.name: getattr(stateless, f.name) for f in dataclasses.fields(stateless)})
    sink = ListSink()
    cfg = PipelineConfig(preprocess_workers=2, inference_workers=2, stage_layout=layout)  # type: ignore[arg-type]
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 60), cfg, sink, stateless)
    read = p.source.read

    def slow_read(stop: Any) -> Any:  # a camera's pace: the workers wait inside the take for the next frame
        time.sleep(0.005)
        return read(stop)

    p.source.read = slow_read  # type: ignore[method-assign]
    p.start()
    try:
        time.sleep(0.1)
        p.swap_engine(stateful)
        assert p.done.wait(30) and p.join(timeout=15)
        log = stateful.__dict__["_log"]
        assert log["overlaps"] == 0, f"{log['overlaps']} runs of the stateful engine overlapped"
        assert log["order"] == sorted(log["order"]), "the stateful engine saw frames out of order"
        assert [r["frame_index"] for r in sink.results] == list(range(1, 61)) and p.failed is None
    finally:
        p.source.close()


def test_configured_pool_sizes_do_not_hide_that_a_stateful_model_runs_one_thread(tmp_path: Path) -> None:
    """The plan's thread counts are exported as gauges: with a stateful model one thread runs each stage,
    whatever the configured sizes, and the plan must say so (its reason already did)."""
    from agent.serving.pipeline_publish import SIZING_FRAMES, SIZING_WARMUP

    stateless = _engine()
    fields = {f.name: getattr(stateless, f.name) for f in dataclasses.fields(stateless)}

    class Stateful(Engine):
        @property
        def max_workers(self) -> int | None:
            return 1

    n = SIZING_WARMUP + SIZING_FRAMES + 4
    sink = ListSink()
    cfg = PipelineConfig(preprocess_workers=2, inference_workers=2, stage_layout="pools")
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", n), cfg, sink, Stateful(**fields))
    p.start()
    try:
        assert p.done.wait(60) and p.join(timeout=15)
        stages = p.status().metrics["stages"]
        assert stages["costs"] is not None and "stateful" in stages["reason"]
        assert (stages["preprocess_workers"], stages["inference_workers"]) == (1, 1), stages
        assert len(sink.results) == n
    finally:
        p.source.close()


def test_a_batch_gathered_for_a_batching_engine_never_reaches_a_stateful_one_swapped_in_meanwhile(
        tmp_path: Path) -> None:
    stateless = _engine()
    assert stateless.dynamic_batch
    stateful = _OrderedEngine(**{f.name: getattr(stateless, f.name) for f in dataclasses.fields(stateless)})
    sink = ListSink()
    cfg = PipelineConfig(max_batch=8, batch_timeout_ms=200)
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 40), cfg, sink, stateless)
    read = p.source.read

    def slow_read(stop: Any) -> Any:  # a take spends its batch time-out gathering frames
        time.sleep(0.01)
        return read(stop)

    p.source.read = slow_read  # type: ignore[method-assign]
    p.start()
    try:
        time.sleep(0.1)  # inside the first gathering
        p.swap_engine(stateful)
        assert p.done.wait(30) and p.join(timeout=15)
        assert set(stateful.__dict__["_log"]["batches"]) == {1}, stateful.__dict__["_log"]["batches"]
        assert [r["frame_index"] for r in sink.results] == list(range(1, 41)) and p.failed is None
    finally:
        p.source.close()


def test_frames_lost_to_a_failed_stage_are_counted_as_pipeline_failed(tmp_path: Path) -> None:
    video = _mjpeg(tmp_path / "cam.avi", 200)
    engine = _engine()
    broken = dataclasses.replace(engine, preprocessor=_BrokenPreprocessor(engine.preprocessor))
    for sink, eng in ((_SlowSinkThatBreaks(20), engine), (ListSink(), broken)):
        p = _pipeline(video, PipelineConfig(preprocess_workers=2), sink, eng)
        p.start()
        try:
            assert p.join(timeout=30) and p.failed is not None
            assert p.metrics.frames_in == len(sink.results) + sum(p.drops.values()), (p.metrics.frames_in,
                                                                                       len(sink.results), p.drops)
        finally:
            p.stop()
            p.source.close()


def test_a_sink_whose_close_fails_still_ends_the_pipeline_as_done_and_failed(tmp_path: Path) -> None:
    class CloseFails(ListSink):
        def close(self) -> None:
            raise OSError("cannot flush")

    sink = CloseFails()
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 10), PipelineConfig(), sink)
    p.start()
    try:
        assert p.join(timeout=30)
        assert len(sink.results) == 10 and p.failed is not None and "cannot flush" in p.failed
        assert p.done.is_set() and not p.status().running
    finally:
        p.source.close()


def test_a_failed_publisher_says_so_before_it_says_done(tmp_path: Path) -> None:
    """The owner reads `failed`, then `done`: done with no failure is a finite source that ended (exit 0),
    so a pipeline that died must never show done before failed."""
    import threading

    p = _pipeline(_mjpeg(tmp_path / "cam.avi", 30), PipelineConfig(), _SlowSinkThatBreaks(5))
    seen: list[str | None] = []

    class Witness(threading.Event):
        def set(self) -> None:
            seen.append(p.failed)
            super().set()

    p.done = Witness()
    p.start()
    try:
        assert p.join(timeout=30) and p.failed is not None
        assert seen and seen[0] is not None, "done was set while failed was still None"
    finally:
        p.source.close()


def _burn(ms: float) -> None:
    end = time.thread_time_ns() + ms * 1e6
    while time.thread_time_ns() < end:
        pass


class _DecoderWithHelperThreads:
    """A source that, like FFmpeg decoding H.264, spends CPU in its read thread and as much again in
    helper threads that the read thread's own CPU clock does not see."""

    def __init__(self, inner: Any, ms: float) -> None:
        self._inner, self._ms = inner, ms

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read(self, stop: Any) -> Any:
        import threading

        helper = threading.Thread(target=_burn, args=(self._ms,))
        helper.start()
        _burn(self._ms)
        helper.join()
        return self._inner.read(stop)


def test_cpu_of_helper_threads_is_seen_with_many_sources(tmp_path: Path) -> None:
    """Each frame is captured once, by one source's thread: the stages' own CPU per frame counts capture
    once, not once per source (4 sources hid the helper threads' 4 ms per frame entirely)."""
    from agent.serving.multisource import MultiSource
    from agent.serving.pipeline_publish import SIZING_FRAMES, SIZING_WARMUP

    engine = _engine()
    per = (SIZING_WARMUP + SIZING_FRAMES) // 4 + 4
    sources = []
    for k in range(4):
        scfg = SourceConfig(type="video", path=_mjpeg(tmp_path / f"cam{k}.avi", per), name=f"cam{k}")
        src = open_source(scfg, engine.bundle.manifest.frame, engine.bundle.manifest.preprocess.resize)
        sources.append((scfg, _DecoderWithHelperThreads(src, 4.0)))
    multi = MultiSource(sources)
    sink = ListSink()
    p = Pipeline(multi, engine, sink, PipelineConfig(), True)
    p.start()
    try:
        assert p.done.wait(60) and p.join(timeout=15)
        assert len(sink.results) == 4 * per
        costs = p.status().metrics["stages"]["costs"]
        assert costs["capture_ms"] >= 3.5
        assert costs["other_ms"] >= 2.0, costs  # the helper threads' 4 ms per frame, less noise
    finally:
        multi.close()


def test_inference_workers_with_the_fused_layout_is_refused_naming_both_keys(tmp_path: Path) -> None:
    from agent.config import load_config
    from agent.errors import ConfigError

    path = tmp_path / "agent.yaml"
    path.write_text("pipeline:\n  stage_layout: fused\n  inference_workers: 3\n")
    with pytest.raises(ConfigError, match=r"pipeline\.inference_workers: 3 has no effect with pipeline\.stage_layout: fused"):
        load_config(path)
    path.write_text("pipeline:\n  stage_layout: fused\n  preprocess_workers: 3\n")
    assert load_config(path).pipeline.preprocess_workers == 3


class _ColdStartEngine(Engine):
    """Its first runs are slow (a session's first runs allocate and tune): what the warm-up skips."""

    def run(self, tensor: np.ndarray, source: str = "", at: float | None = None, metadata: Any = None,
            frame: Any = None) -> Any:
        runs = self.__dict__.setdefault("_runs", [0])
        runs[0] += 1
        if runs[0] <= 8:
            _burn(100.0)
        return super().run(tensor, source, at, metadata, frame)


def test_a_new_engine_is_sized_on_its_own_warm_results_not_the_old_engines_in_flight(tmp_path: Path) -> None:
    from agent.serving.pipeline_publish import SIZING_FRAMES, SIZING_WARMUP

    old = _engine()
    new = _ColdStartEngine(**{f.name: getattr(old, f.name) for f in dataclasses.fields(old)})

    class SlowSink(ListSink):
        def write(self, result: dict[str, Any]) -> None:
            time.sleep(0.002)  # the results queue stays full of the old engine's results
            super().write(result)

    sink = SlowSink()
    n = 300
    p = _pipeline(_mjpeg(tmp_path / "cam.avi", n), PipelineConfig(), sink, old)
    p.start()
    try:
        while len(sink.results) < 20:
            time.sleep(0.005)
        p.swap_engine(new)
        assert p.done.wait(60) and p.join(timeout=15)
        assert sum(r["provider"] == "CPUExecutionProvider" for r in sink.results) == n
        assert new.__dict__["_runs"][0] >= SIZING_WARMUP + SIZING_FRAMES
        costs = p.status().metrics["stages"]["costs"]
        # warm runs of the demo classifier cost about 2 ms; its 8 cold ones 100 ms each (17 ms a frame over 48)
        assert costs["inference_ms"] < 8, costs
    finally:
        p.source.close()
