"""capture -> preprocess -> infer -> postprocess/publish, as threads joined by bounded queues.

ORT releases the GIL in `run`, and OpenCV in decoding and resizing, so the stages overlap. Preprocessing
(with any deferred JPEG decode) and inference are pools; after its first frames the pipeline measures
the CPU each stage costs per frame and sizes the pools so the slowest stage sets the pace
(`agent/serving/sizing.py`); results are still published in the order frames were taken. Live sources
hand over frames latest-wins (stale frames are dropped and counted); files can run lossless. A bad
frame is counted and skipped; nothing a source delivers can stop the pipeline.

Every captured frame is published or counted in `drops` with a reason. A stage that dies (a bug, a
sink that cannot write) sets `failed` at once: the owner reports not-serving, it does not wait for a
stall. Each engine's frames are tallied apart (`tally`), so probation judges what the new bundle served.

This module owns the threads and queues, control and status, drops, failures and hand-overs; each stage's work
is in pipeline_stages.py (capture, preprocess, infer) and pipeline_publish.py (publish, pool sizing).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Protocol

from agent.config import PipelineConfig
from agent.errors import SwapRefused
from agent.serving.engine import Engine
from agent.logsetup import get_logger
from agent.proof.terms import CPU
from agent.serving.metrics import PipelineMetrics
from agent.serving.pipeline_publish import publish
from agent.serving.pipeline_stages import capture, infer, preprocess
from agent.serving.pipeline_parts import (  # EngineTally, LatestSlot: imported from here by callers too
    _END,
    EngineTally,
    LatestSlot,
    PipelineStatus,
    _CostMeter,
    _Turns,
)
from agent.vocabulary.decoders import DEFAULT_MAX_RESULT_BYTES
from agent.serving.capabilities import Multiplexed
from agent.serving.sizing import StagePlan, initial_plan
from agent.serving.sources import CAPTURE_THREAD, Frame, FrameSource

log = get_logger("pipeline")


class Sink(Protocol):
    def write(self, result: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Pipeline:
    plan: StagePlan  # how the pools are sized now (health, /metrics)
    _fused: bool     # preprocessing and inference in one worker (the CPU provider)

    def __init__(self, source: FrameSource, engine: Engine, sink: Sink, cfg: PipelineConfig, lossless: bool,
                 boot: int = 0, first_seq: int = 1, instance: str = ""):
        self.source, self.sink, self.cfg, self.lossless = source, sink, cfg, lossless
        self.boot = boot  # with seq, identifies a result across agent restarts
        # the live view (agent.link.liveview), when someone may watch: asked per frame, keeps pixels only then
        self.live: Any = None
        many = source if isinstance(source, Multiplexed) else None
        self._view_name: Callable[[Frame], str] = ((lambda f: f.source) if many is not None
                                                   else (lambda f: source.name))
        # what the live view and cmd/snapshot call the sources (read lazily: a test's bare source has no name)
        self.view_names: Callable[[], list[str]] = ((lambda: [g.name for g in many.feeds])
                                                    if many is not None else (lambda: [source.name]))
        self.instance = instance  # the agent process: (instance, seq) is unique even for two agents on one device_id
        self.failed: str | None = None  # "<stage>: <error>" once a stage died
        self.drops: dict[str, int] = {}  # reason -> frames captured and not published
        self._tallies: dict[int, EngineTally] = {id(engine): EngineTally()}
        self._tally_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._close_requested = False
        self._source_closed = False
        self._engine = engine
        self._frame = engine.bundle.manifest.frame  # the frame contract the source was opened for
        self._drops_lock = threading.Lock()
        self._captured_drops = 0  # drops of frames this pipeline captured (not a source's own stale frames)
        if many is not None:  # many sources: a live source's stale frames are dropped before capture
            many.on_drop = self._count_source_drop
        # many sources: a frame queued here is swapped for its source's newer one at the take (never converted)
        self._fresher: Callable[[Frame], Frame | None] | None = many.freshest if many is not None else None
        # many sources and a dynamic batch: up to one frame of each source per inference
        self._batch = cfg.max_batch
        if getattr(cfg, "batch_across_sources", True):
            self._batch = max(self._batch, len(many.feeds) if many is not None else 0)
        self.metrics = PipelineMetrics()
        self.stop_event = threading.Event()
        self.paused = threading.Event()
        self.done = threading.Event()
        self._seq = first_seq - 1  # seq never repeats within a boot: a new pipeline continues it
        self._frames_q: Any = (queue.Queue(maxsize=max(cfg.queue_size, 1)) if lossless
                               else LatestSlot(self._count_drop))
        self._prepared_q: queue.Queue = queue.Queue(maxsize=max(cfg.queue_size, 1))
        self._results_q: queue.Queue = queue.Queue(maxsize=max(cfg.queue_size * 4, 8))
        self.cores = len(os.sched_getaffinity(0))
        # Pools: a configured size is fixed; 0 means up to the cores (inference at most 4), sized at start.
        self._pre_fixed = cfg.preprocess_workers
        self._inf_fixed = cfg.inference_workers
        self._pre_max = self._pre_fixed or min(self.cores, 4)
        self._workers = self._inf_fixed or min(self.cores, 4)
        self._layout = cfg.stage_layout
        self._start_layout(engine)
        self._costs = _CostMeter()
        self._sized_results = 0  # results of the current engine counted towards its sizing
        self._process_ns0 = 0
        self._decode0: dict[int, tuple[int, int]] = {}  # each video source's decode meter when measuring began
        self._take_lock = threading.Lock()  # frames are taken and numbered in capture order
        self._turns = _Turns()
        self._number = 0
        self._pre_left = self._pre_max  # preprocessing threads still running; the last one ends inference
        self._pre_closing = threading.Event()
        self._inf_closing = threading.Event()
        self.max_result_bytes = DEFAULT_MAX_RESULT_BYTES  # the daemon sets output.max_result_bytes
        self._threads = [
            threading.Thread(target=self._guard(self._capture), name=CAPTURE_THREAD, daemon=True),
            *(threading.Thread(target=self._guard(self._preprocess), args=(i,), name=f"preprocess-{i}", daemon=True)
              for i in range(self._pre_max)),
            *(threading.Thread(target=self._guard(self._infer), args=(i,), name=f"infer-{i}", daemon=True)
              for i in range(self._workers)),
            threading.Thread(target=self._guard(self._publish), name="publish", daemon=True),
        ]
        pre, inf = self._threads[1:1 + self._pre_max], self._threads[1 + self._pre_max:-1]
        # who takes from each queue: a hand-over gives up only when the pipeline failed and none of them lives
        self._takers = {id(self._frames_q): pre, id(self._prepared_q): inf, id(self._results_q): self._threads[-1:]}

    # -- control ---------------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def last_seq(self) -> int:
        return self._seq

    def tally(self, engine: Engine) -> EngineTally:
        with self._tally_lock:
            return self._tallies.setdefault(id(engine), EngineTally())

    def swap_engine(self, engine: Engine) -> None:
        """Frames preprocessed for the old engine finish on it; the next frame uses the new one."""
        with self._tally_lock:
            self._tallies[id(engine)] = EngineTally()  # a fresh record, even for an engine served before
        if engine.bundle.manifest.frame.kind == "sensor" and engine.bundle.manifest.frame != self._frame:
            # the source was opened for another frame contract (window, hop, its gap rule, latest-frame-wins or
            # lossless): the new engine must get a source opened for its own, as at boot
            raise SwapRefused(f"the new bundle's sensor frame differs from the one the source was opened for "
                              f"({self._frame} -> {engine.bundle.manifest.frame}): restart the pipeline")
        if engine.feeder is not None and self._engine.feeder is not None and engine.feeder is not self._engine.feeder:
            engine.feeder.take_over(self._engine.feeder)
        old, self._engine = self._engine, engine
        self._sized_results = 0  # a new model costs what it costs: measured and sized again
        if self._fuse_for(engine) != self._fused:  # another provider: the other layout, all threads until sized
            self._start_layout(engine)
        log.info("pipeline.engine_swapped", old=old.describe(), new=engine.describe())

    def start(self) -> "Pipeline":
        self._running = len(self._threads)
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop reading; frames already captured finish and are published."""
        self.stop_event.set()

    def close_source(self) -> None:
        """Release the source once the capture thread is out of `read()`: closing a VideoCapture under a
        read in progress crashes or hangs it. If capture is still inside, it closes on its way out."""
        with self._close_lock:
            self._close_requested = True
            if self._threads[0].is_alive() or self._source_closed:
                return
            self._source_closed = True
        self.source.close()

    def _close_source_if_requested(self) -> None:
        with self._close_lock:
            if not self._close_requested or self._source_closed:
                return
            self._source_closed = True
        self.source.close()

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def status(self) -> PipelineStatus:
        st = self.source.stats
        age = (time.perf_counter_ns() - st.last_frame_ns) / 1e9 if st.last_frame_ns else None
        return PipelineStatus(not self.done.is_set(), st.state, None if age is None else round(age, 3),
                              self._engine.describe(), {**self.metrics.snapshot(), "stages": self.plan.to_dict()})

    def stalled(self, horizon_s: float) -> str | None:
        """Why the pipeline is hung, or None. An idle source (no frames) is not hung; a source stuck
        inside a read, or frames captured with no result coming out, is. With many sources the capture is
        hung only when every running source is stuck (nothing serves): one stuck among serving ones is
        reported in its own health, and the watchdog stays fed for the others."""
        if self.done.is_set() or self.paused.is_set():
            return None
        now = time.monotonic()
        # many sources: each judged on its own, named here
        stuck = self.source.stuck(horizon_s) if isinstance(self.source, Multiplexed) else {}
        quiet = now - self.source.stats.heartbeat  # many sources: the newest heartbeat of any running one
        if quiet > horizon_s:
            where = (", ".join(f"{name} for {s:.0f} s" for name, s in stuck.items()) if stuck
                     else f"{self.source.name} for {quiet:.0f} s")
            return f"capture stuck in {where}"
        m = self.metrics
        if m.last_capture > m.last_progress and now - m.last_progress > horizon_s:
            return f"frames captured but no result for {now - m.last_progress:.0f} s"
        return None

    # -- drops, failures and hand-overs, shared by the stages ----------------------------------------
    def _count_drop(self, reason: str = "stale", n: int = 1, captured: bool = True) -> None:
        """Frames captured and never published, by reason; `stale` is latest-frame-wins. Pool threads count
        at once: under a lock."""
        with self._drops_lock:
            self.drops[reason] = self.drops.get(reason, 0) + n
            if captured:
                self._captured_drops += n
            if reason == "stale":
                self.metrics.dropped += n

    def _count_source_drop(self, reason: str = "stale", n: int = 1) -> None:
        """Many sources: frames a source dropped before the capture thread took them."""
        self._count_drop(reason, n, captured=False)

    def _count_lost_to_failure(self) -> None:
        """Once every thread of a failed pipeline ended: the frames it captured and neither published nor
        counted (in a queue, in the hands of the thread that died) were lost to the failure."""
        lost = self.metrics.frames_in - self.metrics.frames_out - self._captured_drops
        if lost > 0:
            self._count_drop("pipeline_failed", lost)

    def _record_failure(self, stage: str, exc: BaseException) -> None:
        """The first failure is the one reported (what follows from it is not news)."""
        with self._drops_lock:
            if self.failed is None:
                self.failed = f"{stage} stage died: {type(exc).__name__}: {exc}"

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                guarded(*args)
            finally:
                with self._drops_lock:
                    self._running -= 1
                    last = self._running == 0
                if last and self.failed is not None:
                    self._count_lost_to_failure()

        def guarded(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as exc:  # a stage bug must not hang the others: end the stream downstream
                self._record_failure(fn.__name__.lstrip('_'), exc)
                log.exception("pipeline.stage_crashed", stage=fn.__name__)
                self.stop_event.set()
                for q in (self._frames_q, self._prepared_q, self._results_q):
                    try:
                        q.put(_END) if isinstance(q, LatestSlot) else q.put(_END, timeout=1)
                    except queue.Full:
                        pass
        return run

    def _hand_over(self, q: queue.Queue, item: Any, frames: int = 0) -> bool:
        """Put into a bounded queue, waiting while anything may still take from it. Once the pipeline failed
        and every thread that takes from `q` is gone, nothing ever will: the item is given up (its `frames`
        counted) instead of blocking this thread for ever."""
        while True:
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self.failed is not None and not any(t.is_alive() for t in self._takers[id(q)]):
                    if frames:
                        self._count_drop("pipeline_failed", frames)
                    return False

    def _start_layout(self, engine: Engine) -> None:
        """The layout `engine` runs in, every pool at its largest until its costs are measured."""
        self._fused = self._fuse_for(engine)
        self.plan = initial_plan(self.cores, self._pre_max, self._workers, self._fused)
        self._pre_active, self._inf_active = self.plan.preprocess_workers, self.plan.inference_workers

    def _fuse_for(self, engine: Engine) -> bool:
        """Preprocess and run the model in one worker: on the CPU provider, unless pools were asked for
        (`stage_layout: pools`, or a fixed `inference_workers`)."""
        if self._layout != "auto":
            return self._layout == "fused"
        return engine.candidate.provider == CPU and not self._inf_fixed

    def _in_order_only(self) -> bool:
        """A stateful model's frames must reach it one at a time in the order they came."""
        return self._engine.max_workers == 1

    def _has_failed(self) -> bool:
        return self.failed is not None

    # -- the stages' threads: each one's work is in pipeline_stages.py (capture, preprocess, infer) and
    # pipeline_publish.py (publish, and the sizing measured from its results) --------------------------
    def _capture(self) -> None:
        capture(self)

    def _preprocess(self, index: int = 0) -> None:
        preprocess(self, index)

    def _infer(self, index: int = 0) -> None:
        infer(self, index)

    def _publish(self) -> None:
        publish(self)
