"""What every frame source hands the pipeline: a frame whose decode waits for its first reader, the
source's counters, the protocol, the pacing of a source that must not outrun its declared rate."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np


def _released(_: Any) -> np.ndarray:
    raise RuntimeError("this frame's pixels were released once its model input was made (Frame.release): "
                       "read what you need before preprocessing")


class Frame:
    """One captured frame. `data` is in the bundle's frame contract.

    `scale` > 1: decoded at 1/scale of the camera's frame (map boxes back with decoding.scaled_geometry).
    `item`: with many sources, `source` is the source's name and `item` what that source called the frame.
    `convert`: a colour conversion still owed, done once on the first read of `data` -- by the
    preprocessing stage, so the capture thread never converts a full frame.
    """

    __slots__ = ("index", "_data", "captured_at", "captured_ns", "source", "scale", "_convert", "item", "full")

    def __init__(self, index: int, data: np.ndarray, captured_at: float, captured_ns: int, source: str,
                 scale: int = 1, convert: Callable[[np.ndarray], np.ndarray] | None = None,
                 full: tuple[int, int] | None = None):
        self.index = index
        self._data: Any = data  # pixels, an encoded packet or a decoder frame still to convert; None once released
        self.captured_at = captured_at  # wall clock, for results
        self.captured_ns = captured_ns  # monotonic, for latency
        self.source = source
        self.scale = scale
        self._convert = convert
        self.item: str | None = None  # within a named source of many: the file the frame came from
        self.full = full  # the camera frame's (height, width) where a reduced decode knows it (boxes clip to it)

    @property
    def data(self) -> np.ndarray:
        if self._convert is not None:
            self._data, self._convert = self._convert(self._data), None
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data, self._convert = value, None

    def release(self) -> None:
        """Drop the pixels once the model's input is made: a full-size decoded frame (6 MB at 1080p) is then not
        held while the model runs and the result waits its turn to be published. Reading `data` after raises."""
        self._data, self._convert = None, _released

    def settled(self, dropped: bool = False) -> None:
        """The pipeline is done with this frame: its result published, or (`dropped`) the frame dropped. A no-op
        here; a sensor window tells its stream, whose backlog counts the windows taken and not yet served and
        whose `dropped_samples` counts those dropped."""

    def __repr__(self) -> str:
        data: Any = self._data
        shape = None if data is None else getattr(data, "shape", None) or (data.height, data.width)  # av.VideoFrame
        return (f"Frame(index={self.index}, source={self.source!r}, shape={shape}, scale={self.scale}, "
                f"converted={self._convert is None}{', released' if self._convert is _released else ''})")


@dataclass
class SourceStats:
    state: str = "starting"  # starting | open | lost | frozen | ended
    frames: int = 0
    bad: int = 0
    reconnects: int = 0
    losses: int = 0
    frozen_events: int = 0
    last_frame_ns: int = 0
    last_error: str | None = None
    heartbeat: float = field(default_factory=time.monotonic)  # the source's loop is alive (watchdog)
    # how frames are decoded, for health: path (jpeg | ffmpeg | image | none), codec, scale, threads, hw
    decoder: dict[str, Any] = field(default_factory=dict)
    cpu_ns: int = 0      # CPU time of the reads that delivered frames (the pipeline sizes its stages by it)
    cpu_frames: int = 0

    def beat(self) -> None:
        self.heartbeat = time.monotonic()


CAPTURE_THREAD = "capture"  # the name every thread that reads a source starts with (the pipeline's, one per source)


def reads_in_flight() -> list[str]:
    """The capture threads still alive, each inside a source's read that its stop could not end (a stuck
    camera). Interpreter teardown must not run under such a read: FFmpeg's interrupt callback in PyAV takes
    the GIL every ~100 ms, and once teardown has freed the thread's state that is a use after free (an agent
    ended -11 on SIGTERM with a stuck camera). The CLI ends the process with os._exit when this is not empty."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(CAPTURE_THREAD) and t.is_alive())


class FrameSource(Protocol):
    name: str
    live: bool

    @property
    def stats(self) -> SourceStats: ...

    def read(self, stop: threading.Event) -> Frame | None:
        """The next frame; None when the source has ended for good or `stop` is set. May raise BadFrame."""

    def close(self) -> None: ...


def now_pair() -> tuple[float, int]:
    return time.time(), time.perf_counter_ns()


class Pacer:
    def __init__(self, max_fps: float):
        self.period = 1.0 / max_fps if max_fps > 0 else 0.0
        self.next = time.monotonic()

    def wait(self, stop: threading.Event, stats: "SourceStats") -> None:
        if self.period:
            while not stop.is_set() and (delay := self.next - time.monotonic()) > 0:
                stats.beat()  # a slow pace is not a hang
                stop.wait(min(delay, 1.0))
            self.next = max(self.next + self.period, time.monotonic())
