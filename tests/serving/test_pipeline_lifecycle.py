"""Pipeline lifecycle faults: the source is released only once capture has left `read()`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.config import PipelineConfig
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.serving.pipeline import Pipeline
from agent.serving.sources import Frame, SourceStats
from agent.testing import ListSink
from pipelines import run_to_end

ROOT = Path(__file__).resolve().parents[2]


class StuckCamera:
    """Like a VideoCapture on a stream that stopped answering: read() blocks for a while, and
    releasing it while a read is in progress is the crash this guards against."""

    live = True
    name = "stuck-camera"

    def __init__(self) -> None:
        self.stats = SourceStats(state="open")
        self.reading = threading.Event()
        self.closed_during_read = False
        self.closed = False
        self.n = 0
        self.release = threading.Event()  # the hung read returns only when the test says so

    def read(self, stop: threading.Event) -> Frame | None:
        self.reading.set()
        try:
            self.n += 1
            if self.n > 3:
                # a read that does not notice stop: the network stream hangs (until the test lets it go;
                # a fixed 2 s could end before the asserts below on a loaded machine)
                self.release.wait(60)
            return Frame(self.n, np.zeros((28, 28), np.uint8), time.time(), time.perf_counter_ns(), self.name)
        finally:
            self.reading.clear()

    def close(self) -> None:
        if self.reading.is_set():
            self.closed_during_read = True
        self.closed = True


def test_stop_pipeline_never_releases_the_capture_while_read_is_in_progress() -> None:
    """Fault: stop_pipeline joined with a time-out, then released the VideoCapture while the capture
    thread could still be inside read()."""
    b = load_bundle(ROOT / "models" / "digits-classifier", check_contracts=False)
    engine = build_engine(b, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())
    cam = StuckCamera()
    p = Pipeline(cam, engine, ListSink(), PipelineConfig(), lossless=False).start()
    deadline = time.monotonic() + 10
    while cam.n < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cam.reading.wait(5)
    p.stop()
    assert not p.join(timeout=0.2)  # the controller's join gave up: capture is still inside read()
    p.close_source()
    assert not cam.closed  # deferred, not done under the read
    cam.release.set()  # the stream answers at last
    assert p.join(timeout=10)
    assert cam.closed and not cam.closed_during_read  # capture released it on its way out


class KeptFrames:
    """A finite lossless source that keeps every frame it handed out, to look at them after the run."""

    live = False
    name = "kept"

    def __init__(self, n: int) -> None:
        self.stats = SourceStats(state="open")
        self.frames: list[Frame] = []
        self.n = n

    def read(self, stop: threading.Event) -> Frame | None:
        if len(self.frames) >= self.n:
            return None
        rng = np.random.default_rng(len(self.frames))
        f = Frame(len(self.frames) + 1, rng.integers(0, 255, (28, 28, 3), np.uint8), time.time(), time.perf_counter_ns(),
                  self.name)
        self.frames.append(f)
        return f

    def close(self) -> None:
        pass


def test_a_frames_pixels_are_dropped_once_its_model_input_is_made() -> None:
    """Fault (issue 24, memory): every decoded frame (6 MB at 1080p) stayed referenced by its batch until the
    result was published, through inference and the publisher's in-order wait."""
    b = load_bundle(ROOT / "models" / "digits-classifier", check_contracts=False)
    engine = build_engine(b, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())
    src, sink = KeptFrames(12), ListSink()
    run_to_end(src, engine, sink, PipelineConfig(), lossless=True)
    assert [r["frame_index"] for r in sink.results] == list(range(1, 13))  # every frame served, in order
    held = [f for f in src.frames if f._data is not None]
    assert not held, held
    with pytest.raises(RuntimeError, match="released"):  # a late reader fails loudly, never sees None
        _ = src.frames[0].data
