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
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Protocol

import numpy as np

from agent.config import PipelineConfig
from agent.serving.engine import Engine
from agent.errors import NonFiniteOutput, PreprocessError, ResultTooLargeError, StageOutputError, SwapRefused
from agent.logsetup import get_logger
from agent.proof.terms import CPU
from agent.serving.metrics import PipelineMetrics
from agent.serving.pipeline_parts import (  # noqa: F401 (EngineTally, LatestSlot: imported from here by callers)
    _END,
    EngineTally,
    Inferred,
    LatestSlot,
    PipelineStatus,
    Prepared,
    _CostMeter,
    _inference_cost,
    _Turns,
)
from agent.vocabulary.decoders import DEFAULT_MAX_RESULT_BYTES, split_batch
from agent.serving.decoding import scaled_geometry
from agent.serving.capabilities import Multiplexed, SkipsNonReference
from agent.serving.sizing import StageCosts, StagePlan, initial_plan, plan_stages
from agent.serving.sources import CAPTURE_THREAD, BadFrame, Frame, FrameSource, UndecodableFrame, video_sources

log = get_logger("pipeline")

_WORKER_DONE = object()

# Stage costs are measured over results SIZING_WARMUP+1 .. SIZING_WARMUP+SIZING_FRAMES of each engine
# (the first runs of a session are slow and would oversize the pools).
SIZING_WARMUP = 8
SIZING_FRAMES = 48


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

    # -- stages ----------------------------------------------------------------------------------------
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

    def _capture(self) -> None:
        src, m = self.source, self.metrics
        limit = self.cfg.max_frames
        # latest-frame-wins: while the last frame still waits, a frame nothing references is not decoded
        skip = (src.skip_nonref if isinstance(self._frames_q, LatestSlot) and isinstance(src, SkipsNonReference)
                else None)
        while not self.stop_event.is_set():
            if self.paused.is_set():
                self.stop_event.wait(0.05)
                continue
            if skip is not None:
                skip(self._frames_q.waiting)
            t_cpu = time.thread_time_ns()
            try:
                frame = src.read(self.stop_event)
            except BadFrame as exc:
                m.bad_frames += 1
                log.warning("frame.bad", source=src.name, reason=str(exc), bad_frames=m.bad_frames)
                continue
            if frame is None:
                break
            self._costs.add("capture", time.thread_time_ns() - t_cpu)
            m.frames_in += 1
            m.last_capture = time.monotonic()
            m.rate_in.mark()
            if self.lossless:
                # A frame read is a frame owed: after stop it still goes in (downstream drains to the
                # end marker), unless downstream died, and then it is counted.
                while True:
                    try:
                        self._frames_q.put(frame, timeout=0.1)
                        break
                    except queue.Full:
                        if self.failed is not None:
                            self._count_drop("pipeline_failed")
                            break
            else:
                self._frames_q.put(frame)
            if limit and m.frames_in >= limit:
                break
        self._close_source_if_requested()
        if isinstance(self._frames_q, LatestSlot):
            self._frames_q.put(_END)
        else:
            self._hand_over(self._frames_q, _END)

    def _next_frame(self, timeout: float | None) -> Any:
        try:
            return self._frames_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def _freshest(self, item: Any) -> Any:
        """Many sources: a live source's frame that waited here while a newer one arrived is swapped for the
        newer one (or skipped, None, if that was handed out already) before preprocessing converts it;
        counted stale by the source. Anything else is returned as it is."""
        if self._fresher is None or not isinstance(item, Frame):
            return item
        out = self._fresher(item)
        if out is None:
            self._count_drop("stale")  # captured, and now dropped
        elif out is not item:
            # the newer frame takes the captured one's place in frames_in: the replaced one counts as a
            # source's drop, as if latest-frame-wins had dropped it in the source
            self._count_drop("stale", captured=False)
        return out

    def _put_back_end(self) -> None:
        """Every preprocessing thread must see the end. Under the take lock: a blocking put here would hold
        the others off the queue; if it is full, what fills it is another end marker (a crashed stage's)."""
        try:
            self._frames_q.put(_END) if isinstance(self._frames_q, LatestSlot) else self._frames_q.put_nowait(_END)
        except queue.Full:
            pass

    def _take(self) -> tuple[int, list[Any], Engine, int | None] | None:
        """The next frame, or a batch of frames across sources, numbered in the order taken, with the engine
        that serves it (and, a stateful one, its turn); None at the end."""
        with self._take_lock:
            first = None
            while first is None:  # a frame a newer one of its live source replaced is skipped
                first = self._freshest(self._next_frame(None))
            if first is _END:
                self._put_back_end()
                return None
            engine = self._engine  # bound with the frame, under the lock: a swap falls between two takes
            batch = [first]
            if self._batch > 1 and engine.dynamic_batch:  # the engine that runs the batch decides
                deadline = time.monotonic() + self.cfg.batch_timeout_ms / 1000
                while len(batch) < self._batch:
                    nxt = self._next_frame(max(0.0, deadline - time.monotonic()))
                    if nxt is None:
                        break
                    if nxt is _END:
                        self._put_back_end()  # taken again on the next call
                        break
                    nxt = self._freshest(nxt)
                    if nxt is not None:
                        batch.append(nxt)
            self._number += 1
            return self._number, batch, engine, (self._turns.issue(engine) if engine.max_workers == 1 else None)

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

    def _preprocess(self, index: int = 0) -> None:
        try:
            while not self._pre_closing.is_set():
                if index >= self._pre_active or (index > 0 and self._in_order_only()):
                    self._pre_closing.wait(0.05)  # not needed at the planned size: idle, not gone
                    continue
                taken = self._take()
                if taken is None:
                    self._pre_closing.set()
                    break
                self._prepare(*taken)
        finally:
            with self._take_lock:
                self._pre_left -= 1
                last = self._pre_left == 0
            if last:
                self._hand_over(self._prepared_q, _END)

    def _prepare(self, number: int, batch: list[Frame], engine: Engine, turn: int | None = None) -> None:
        m = self.metrics
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        tensors, frames, geoms = [], [], []
        tally = self.tally(engine)
        with self._tally_lock:  # several pool threads count at once
            tally.frames += len(batch)
        for f in batch:
            try:
                data = f.data  # a deferred decode or colour conversion happens here, once
                tensor, geometry = engine.preprocessor.with_geometry(data)  # a pre graph runs once per frame
                live = self.live
                if live is not None and live.wanted(name := self._view_name(f)):  # someone watches: a copy
                    live.keep(id(f), name, data, f.scale, engine.bundle.manifest.frame.color == "rgb")
                del data
                f.release()  # nothing after this reads the pixels: only the tensor travels on
                tensors.append(tensor)
                # a frame decoded at 1/scale: boxes are mapped back to the camera's pixels
                geoms.append(scaled_geometry(geometry, f.scale, f.full))
                frames.append(f)
            except PreprocessError as exc:
                with self._tally_lock:
                    m.bad_frames += 1
                    if not isinstance(exc, UndecodableFrame):
                        tally.refused += 1
                self._count_drop("bad_frame" if isinstance(exc, UndecodableFrame) else "refused_by_preprocessing")
                log.warning("frame.bad", source=f.source, index=f.index, reason=str(exc), bad_frames=m.bad_frames)
                f.settled(dropped=True)
        if not frames:  # the number is spent: tell the publisher so it does not wait for it
            if turn is not None:
                self._turns.finish(engine, turn, "hand_over", "run")
            self._hand_over(self._results_q, Inferred(Prepared(number, [], np.empty(0), engine, [], t0, 0.0), None, 0.0))
            return
        tensor = tensors[0] if len(tensors) == 1 else np.concatenate(tensors)
        t1 = time.perf_counter_ns()
        self._costs.add("preprocess", time.thread_time_ns() - c0, len(frames))
        prepared = Prepared(number, frames, tensor, engine, geoms, t0, (t1 - t0) / 1e6, turn)
        if self._fuse_for(engine):  # this thread runs the model too: one hand-over less, no core waiting on another
            self._hand_over_result(self._run_model(prepared))
            return
        if turn is not None and not self._turns.wait(engine, "hand_over", turn, self._has_failed):
            self._count_drop("pipeline_failed", len(frames))
            return
        try:
            self._hand_over(self._prepared_q, prepared, len(frames))
        finally:
            if turn is not None:
                self._turns.finish(engine, turn, "hand_over")

    def _infer(self, index: int = 0) -> None:
        try:
            while not self._inf_closing.is_set():
                if index >= self._inf_active or (index > 0 and self._in_order_only()):
                    self._inf_closing.wait(0.05)
                    continue
                try:
                    p = self._prepared_q.get(timeout=0.1)
                except queue.Empty:
                    continue
                if p is _END:
                    self._hand_over(self._prepared_q, _END)  # the other workers need to see it too
                    self._inf_closing.set()
                    break
                self._hand_over_result(self._run_model(p))
        finally:
            self._hand_over(self._results_q, _WORKER_DONE)

    def _hand_over_result(self, item: Inferred) -> None:
        """To the publisher; a failed inference was counted already."""
        self._hand_over(self._results_q, item, 0 if item.outputs is None else len(item.prepared.frames))

    def _has_failed(self) -> bool:
        return self.failed is not None

    def _run_model(self, p: Prepared) -> Inferred:
        if p.turn is None:
            return self._run_model_now(p)
        if not self._turns.wait(p.engine, "run", p.turn, self._has_failed):
            self._count_drop("pipeline_failed", len(p.frames))
            return Inferred(p, None, 0.0)
        try:
            return self._run_model_now(p)
        finally:
            self._turns.finish(p.engine, p.turn, "run")

    def _run_model_now(self, p: Prepared) -> Inferred:
        m = self.metrics
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            outputs: dict[str, np.ndarray] | None = p.engine.run(p.tensor, p.frames[0].source,
                                                                  p.frames[0].captured_at, frame=p.frames[0])
            assert outputs is not None
            bad = p.engine.non_finite(outputs)
            if bad:  # NaN/inf answers are wrong answers: counted, never published
                raise NonFiniteOutput(f"non-finite values in outputs {bad}")
        except Exception as exc:  # a runtime failure on one input is counted, not fatal
            tally = self.tally(p.engine)
            with self._tally_lock:  # several workers count at once
                m.inference_errors += 1
                if isinstance(exc, NonFiniteOutput):
                    tally.non_finite += 1
                else:
                    tally.inference_errors += 1
            self._count_drop("non_finite_output" if isinstance(exc, NonFiniteOutput) else "inference_error",
                             len(p.frames))
            log.error("inference.error", error=f"{type(exc).__name__}: {exc}", errors=m.inference_errors)
            outputs = None
        wall_ns, cpu_ns = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
        self._costs.add("inference", _inference_cost(p.engine, wall_ns, cpu_ns), len(p.frames))
        return Inferred(p, outputs, wall_ns / 1e6)

    def _size_stages(self) -> None:
        """Called by the publisher after each result: measure over the first frames, then size the pools."""
        self._sized_results += 1
        if self._sized_results == SIZING_WARMUP:
            self._costs.reset()
            self._process_ns0 = time.process_time_ns()
            self._decode0 = {id(v): (v.decode_meter.wait_ns, v.decode_meter.frames) for v in video_sources(self.source)}
            return
        if self._sized_results != SIZING_WARMUP + SIZING_FRAMES:
            return
        src = self.source
        capture = src.capture_cpu_ms() if isinstance(src, Multiplexed) else self._costs.per_frame_ms("capture")
        own = [self._costs.per_frame_ms(s) for s in ("preprocess", "inference", "publish")]
        process_ms = (time.process_time_ns() - self._process_ns0) / 1e6 / SIZING_FRAMES
        # each frame was captured once, by one source's thread: its capture counts once, however many sources
        other = max(0.0, process_ms - capture - sum(own))
        costs = StageCosts(capture, own[0], own[1], own[2], SIZING_FRAMES, other)
        in_order = self._in_order_only()
        videos = {v.name: v for v in video_sources(src)}
        loads = [load for v in videos.values() if (load := v.decoder_load(self._decode0.get(id(v), (0, 0))))]
        plan = plan_stages(costs, cores=self.cores, sources=len(src.feeds) if isinstance(src, Multiplexed) else 1,
                           preprocess_max=self._pre_max, inference_max=self._workers, in_order=in_order,
                           fused=self._fused, decoders=loads)
        for d in plan.decoders:  # taken by each decoder at its next keyframe
            videos[d.source].plan_decoder(d.threads, d.reason)
        # configured sizes are kept, except that a stateful model's frames go one at a time (only the first
        # thread of each pool serves them): the plan, exported as gauges, says what really runs
        if self._pre_fixed and not in_order:
            plan = replace(plan, preprocess_workers=self._pre_fixed)
        if self._inf_fixed and not self._fused and not in_order:
            plan = replace(plan, inference_workers=self._inf_fixed)
        self.plan = plan
        self._pre_active, self._inf_active = plan.preprocess_workers, plan.inference_workers
        log.info("pipeline.stages_sized", preprocess_workers=plan.preprocess_workers,
                 inference_workers=plan.inference_workers, bottleneck=plan.bottleneck,
                 pace_fps=round(plan.pace_fps, 1), reason=plan.reason,
                 decoder_threads={d.source: d.threads for d in plan.decoders} or None)

    def _in_order(self) -> Any:
        """Results from all inference workers, re-ordered by preparation number."""
        pending: dict[int, Inferred] = {}
        next_number, done = 1, 0
        while done < self._workers:
            item = self._results_q.get()
            if item is _WORKER_DONE:
                done += 1
                continue
            if item is _END:
                break
            pending[item.prepared.number] = item
            while next_number in pending:
                yield pending.pop(next_number)
                next_number += 1
        for number in sorted(pending):
            yield pending[number]

    def _publish(self) -> None:
        """Results in order to the sink. A failure is recorded before `done` is set: the owner takes done
        without a failure for a source that ended."""
        try:
            self._publish_results()
        except BaseException as exc:
            self._record_failure("publish", exc)
            raise
        finally:
            try:
                self.sink.close()
            except BaseException as exc:
                self._record_failure("publish", exc)
                raise
            finally:  # a sink that cannot close fails the pipeline; it still ended
                self.done.set()

    def _publish_results(self) -> None:
        for item in self._in_order():
            try:
                self._publish_item(item)
            finally:  # each frame was settled as published or dropped; a publish that raised drops the rest
                for frame in item.prepared.frames:
                    frame.settled(dropped=True)

    def _publish_item(self, item: Inferred) -> None:
        m = self.metrics
        if item.outputs is None:  # the run failed: counted there
            for frame in item.prepared.frames:
                frame.settled(dropped=True)
            return
        p: Prepared = item.prepared
        eng = p.engine
        n = len(p.frames)
        tally = self.tally(eng)
        for i, frame in enumerate(p.frames):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            outs = split_batch(item.outputs, i, eng.bundle.manifest.batch_axes)
            try:
                result = eng.annotate(frame, eng.decode(outs, p.geometry[i], self.max_result_bytes))
            except StageOutputError as exc:  # a post graph's outputs its kind refuses: counted, never served
                m.result_errors += 1
                tally.post_refused += 1
                self._count_drop("post_stage_refused")
                log.error("result.post_stage_refused", source=frame.source, index=frame.index, reason=str(exc),
                          result_errors=m.result_errors)
                frame.settled(dropped=True)
                continue
            except ResultTooLargeError as exc:  # counted, never a multi-megabyte message
                m.result_errors += 1
                self._count_drop("result_too_large")
                log.error("result.too_large", source=frame.source, index=frame.index, reason=str(exc),
                          result_errors=m.result_errors)
                frame.settled(dropped=True)
                continue
            t1 = time.perf_counter_ns()
            self._seq += 1
            timings = {
                "queue_ms": round((p.dequeued_ns - frame.captured_ns) / 1e6, 3),
                "preprocess_ms": round(p.preprocess_ms / n, 3),
                "inference_ms": round(item.inference_ms, 3),
                "postprocess_ms": round((t1 - t0) / 1e6, 3),
                "total_ms": round((t1 - frame.captured_ns) / 1e6, 3),
            }
            for key in ("queue", "preprocess", "inference", "postprocess", "total"):
                m.observe(key, timings[f"{key}_ms"])
            self.sink.write({
                "boot": self.boot,
                **({"instance": self.instance} if self.instance else {}),
                "seq": self._seq,
                "captured_at": round(frame.captured_at, 6),
                "source": frame.source,
                **({"item": frame.item} if frame.item is not None else {}),
                "frame_index": frame.index,
                "bundle": {"name": eng.bundle.manifest.name, "version": eng.bundle.manifest.version},
                "variant": eng.candidate.variant,
                "provider": eng.candidate.provider,  # verified against the session's effective list
                "batch": n,
                "timings": timings,
                "result": result,
            })
            frame.settled()
            if self.live is not None:
                self.live.served(id(frame), self._seq, result)
            m.frames_out += 1
            tally.results += 1
            if len(tally.inference_ms) < EngineTally.MAX_SAMPLES:
                tally.inference_ms.append(item.inference_ms)
            m.rate_out.mark()
            m.last_progress = time.monotonic()
            self._costs.add("publish", time.thread_time_ns() - c0)
            if eng is self._engine:  # after a swap, the old engine's results still in flight are not the new one's
                self._size_stages()

