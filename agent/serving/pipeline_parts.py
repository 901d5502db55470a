"""The pipeline's small parts: the latest-frame slot, the values handed between its stages (a prepared batch, an
inferred one), the turns that keep batches in order across inference workers, each engine's tally (what
probation judges) and the stage cost meter, and the pipeline's status."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from agent.proof.terms import CPU
from agent.serving.engine import Engine
from agent.serving.sources import Frame

_END = object()  # the end of the frames: what a stage passes on when the source ended or stop was asked
_WORKER_DONE = object()  # an inference worker ended: the publisher counts them before it ends


class LatestSlot:
    """A one-frame mailbox: put overwrites (counting the drop), get waits."""

    def __init__(self, on_drop: Callable[[], None]):
        self._cond = threading.Condition()
        self._item: Any = None
        self._full = False
        self._on_drop = on_drop

    def put(self, item: Any) -> None:
        dropped = None
        with self._cond:
            if self._full and self._item is not _END:
                self._on_drop()
                dropped = self._item
            if not (self._full and self._item is _END):
                self._item, self._full = item, True
            self._cond.notify()
        if isinstance(dropped, Frame):  # outside the box's lock: a sensor window tells its source's stream
            dropped.settled(dropped=True)

    @property
    def waiting(self) -> bool:
        """A frame is in the box, not taken yet: the next one will replace it."""
        return self._full and self._item is not _END

    def get(self, timeout: float | None = None) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: self._full, timeout):
                raise queue.Empty
            item, self._item, self._full = self._item, None, False
            return item


@dataclass
class Prepared:
    number: int  # order of preparation; results are published in this order
    frames: list[Frame]
    tensor: np.ndarray
    engine: Engine
    geometry: list[Any]
    dequeued_ns: int
    preprocess_ms: float
    turn: int | None = None  # a stateful engine's frames: their place in its order (see _Turns)


class _Turns:
    """A stateful engine's frames in the order they were taken, whichever threads carry them: a ticket is
    issued as a frame is taken, and each step (the hand-over to inference, the run) waits for its ticket.
    Checking the engine before taking a frame is not enough: a worker may wait inside the take across an
    engine swap and come out holding a frame for a stateful engine while another worker takes the next."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued: dict[int, int] = {}
        self._done: dict[tuple[int, str], int] = {}

    def issue(self, engine: Engine) -> int:
        with self._cond:
            n = self._issued.get(id(engine), 0)
            self._issued[id(engine)] = n + 1
            return n

    def wait(self, engine: Engine, step: str, ticket: int, give_up: Callable[[], bool]) -> bool:
        with self._cond:
            while self._done.get((id(engine), step), 0) != ticket:
                if give_up():
                    return False
                self._cond.wait(0.1)
            return True

    def finish(self, engine: Engine, ticket: int, *steps: str) -> None:
        with self._cond:
            for step in steps:
                key = (id(engine), step)
                self._done[key] = max(self._done.get(key, 0), ticket + 1)
            self._cond.notify_all()


@dataclass
class Inferred:
    prepared: Prepared
    outputs: dict[str, np.ndarray] | None  # None: inference failed, counted, nothing to publish
    inference_ms: float


@dataclass
class EngineTally:
    """What one engine really served: the evidence probation judges."""

    frames: int = 0          # frames handed to this engine's preprocessing
    results: int = 0         # results published
    refused: int = 0         # frames its preprocessing refused (frame-format mismatch)
    inference_errors: int = 0
    non_finite: int = 0      # inferences with NaN/inf outputs (never published)
    post_refused: int = 0    # results its post stage refused (StageOutputError: never published)
    inference_ms: list[float] = field(default_factory=list)  # bounded by MAX_TALLY_SAMPLES

    MAX_SAMPLES = 4096


class _CostMeter:
    """CPU nanoseconds and frames per stage, summed by the stages' threads (a pool has several writers)."""

    STAGES = ("capture", "preprocess", "inference", "publish")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.ns = dict.fromkeys(self.STAGES, 0)
            self.frames = dict.fromkeys(self.STAGES, 0)

    def add(self, stage: str, ns: int, frames: int = 1) -> None:
        with self._lock:
            self.ns[stage] += ns
            self.frames[stage] += frames

    def per_frame_ms(self, stage: str) -> float:
        with self._lock:
            return self.ns[stage] / 1e6 / self.frames[stage] if self.frames[stage] else 0.0


def _inference_cost(engine: Engine, wall_ns: int, cpu_ns: int) -> int:
    """What one run costs the stage: on the CPU provider with one intra-op thread the run happens on the
    calling thread (its CPU time is exact); with more, they run beside it; on an accelerator the device's
    time is the cost, and the caller mostly waits."""
    if engine.candidate.provider != CPU:
        return wall_ns
    return cpu_ns if engine.intra_op_threads == 1 else wall_ns * engine.intra_op_threads


@dataclass
class PipelineStatus:
    running: bool
    source_state: str
    last_frame_age_s: float | None
    engine: dict[str, Any] | None
    metrics: dict[str, Any] = field(default_factory=dict)
