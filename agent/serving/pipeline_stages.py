"""The pipeline's frame-side stages, each run by its threads (agent.serving.pipeline owns them): capture (the
source's frames into the frame queue, latest-wins or lossless), the take (numbered in capture order, batched across
sources, a stale frame swapped for its source's newer one), preprocessing (tensor and geometry, a live-view copy) and
inference (the model run in a stateful model's turn, a failure on one input counted, not fatal).
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.errors import NonFiniteOutput, PreprocessError
from agent.logsetup import get_logger
from agent.serving.capabilities import SkipsNonReference
from agent.serving.decoding import scaled_geometry
from agent.serving.engine import Engine
from agent.serving.pipeline_parts import (
    _END,
    _WORKER_DONE,
    Inferred,
    LatestSlot,
    Prepared,
    _inference_cost,
)
from agent.serving.sources import BadFrame, Frame, UndecodableFrame

if TYPE_CHECKING:
    from agent.serving.pipeline import Pipeline

log = get_logger("pipeline")


def capture(pipe: Pipeline) -> None:
    src, m = pipe.source, pipe.metrics
    limit = pipe.cfg.max_frames
    # latest-frame-wins: while the last frame still waits, a frame nothing references is not decoded
    skip = (src.skip_nonref if isinstance(pipe._frames_q, LatestSlot) and isinstance(src, SkipsNonReference)
            else None)
    while not pipe.stop_event.is_set():
        if pipe.paused.is_set():
            pipe.stop_event.wait(0.05)
            continue
        if skip is not None:
            skip(pipe._frames_q.waiting)
        t_cpu = time.thread_time_ns()
        try:
            frame = src.read(pipe.stop_event)
        except BadFrame as exc:
            m.bad_frames += 1
            log.warning("frame.bad", source=src.name, reason=str(exc), bad_frames=m.bad_frames)
            continue
        if frame is None:
            break
        pipe._costs.add("capture", time.thread_time_ns() - t_cpu)
        m.frames_in += 1
        m.last_capture = time.monotonic()
        m.rate_in.mark()
        if pipe.lossless:
            # A frame read is a frame owed: after stop it still goes in (downstream drains to the
            # end marker), unless downstream died, and then it is counted.
            while True:
                try:
                    pipe._frames_q.put(frame, timeout=0.1)
                    break
                except queue.Full:
                    if pipe.failed is not None:
                        pipe._count_drop("pipeline_failed")
                        break
        else:
            pipe._frames_q.put(frame)
        if limit and m.frames_in >= limit:
            break
    pipe._close_source_if_requested()
    if isinstance(pipe._frames_q, LatestSlot):
        pipe._frames_q.put(_END)
    else:
        pipe._hand_over(pipe._frames_q, _END)


def _next_frame(pipe: Pipeline, timeout: float | None) -> Any:
    try:
        return pipe._frames_q.get(timeout=timeout)
    except queue.Empty:
        return None


def _freshest(pipe: Pipeline, item: Any) -> Any:
    """Many sources: a live source's frame that waited here while a newer one arrived is swapped for the
    newer one (or skipped, None, if that was handed out already) before preprocessing converts it;
    counted stale by the source. Anything else is returned as it is."""
    if pipe._fresher is None or not isinstance(item, Frame):
        return item
    out = pipe._fresher(item)
    if out is None:
        pipe._count_drop("stale")  # captured, and now dropped
    elif out is not item:
        # the newer frame takes the captured one's place in frames_in: the replaced one counts as a
        # source's drop, as if latest-frame-wins had dropped it in the source
        pipe._count_drop("stale", captured=False)
    return out


def _put_back_end(pipe: Pipeline) -> None:
    """Every preprocessing thread must see the end. Under the take lock: a blocking put here would hold
    the others off the queue; if it is full, what fills it is another end marker (a crashed stage's)."""
    try:
        pipe._frames_q.put(_END) if isinstance(pipe._frames_q, LatestSlot) else pipe._frames_q.put_nowait(_END)
    except queue.Full:
        pass


def _take(pipe: Pipeline) -> tuple[int, list[Any], Engine, int | None] | None:
    """The next frame, or a batch of frames across sources, numbered in the order taken, with the engine
    that serves it (and, a stateful one, its turn); None at the end."""
    with pipe._take_lock:
        first = None
        while first is None:  # a frame a newer one of its live source replaced is skipped
            first = _freshest(pipe, _next_frame(pipe, None))
        if first is _END:
            _put_back_end(pipe)
            return None
        engine = pipe._engine  # bound with the frame, under the lock: a swap falls between two takes
        batch = [first]
        if pipe._batch > 1 and engine.dynamic_batch:  # the engine that runs the batch decides
            deadline = time.monotonic() + pipe.cfg.batch_timeout_ms / 1000
            while len(batch) < pipe._batch:
                nxt = _next_frame(pipe, max(0.0, deadline - time.monotonic()))
                if nxt is None:
                    break
                if nxt is _END:
                    _put_back_end(pipe)  # taken again on the next call
                    break
                nxt = _freshest(pipe, nxt)
                if nxt is not None:
                    batch.append(nxt)
        pipe._number += 1
        return pipe._number, batch, engine, (pipe._turns.issue(engine) if engine.max_workers == 1 else None)


def preprocess(pipe: Pipeline, index: int = 0) -> None:
    try:
        while not pipe._pre_closing.is_set():
            if index >= pipe._pre_active or (index > 0 and pipe._in_order_only()):
                pipe._pre_closing.wait(0.05)  # not needed at the planned size: idle, not gone
                continue
            taken = _take(pipe)
            if taken is None:
                pipe._pre_closing.set()
                break
            _prepare(pipe, *taken)
    finally:
        with pipe._take_lock:
            pipe._pre_left -= 1
            last = pipe._pre_left == 0
        if last:
            pipe._hand_over(pipe._prepared_q, _END)


def _prepare(pipe: Pipeline, number: int, batch: list[Frame], engine: Engine, turn: int | None = None) -> None:
    m = pipe.metrics
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    tensors, frames, geoms = [], [], []
    tally = pipe.tally(engine)
    with pipe._tally_lock:  # several pool threads count at once
        tally.frames += len(batch)
    for f in batch:
        try:
            data = f.data  # a deferred decode or colour conversion happens here, once
            tensor, geometry = engine.preprocessor.with_geometry(data)  # a pre graph runs once per frame
            live = pipe.live
            if live is not None and live.wanted(name := pipe._view_name(f)):  # someone watches: a copy
                live.keep(id(f), name, data, f.scale, engine.bundle.manifest.frame.color == "rgb")
            del data
            f.release()  # nothing after this reads the pixels: only the tensor travels on
            tensors.append(tensor)
            # a frame decoded at 1/scale: boxes are mapped back to the camera's pixels
            geoms.append(scaled_geometry(geometry, f.scale, f.full))
            frames.append(f)
        except PreprocessError as exc:
            with pipe._tally_lock:
                m.bad_frames += 1
                if not isinstance(exc, UndecodableFrame):
                    tally.refused += 1
            pipe._count_drop("bad_frame" if isinstance(exc, UndecodableFrame) else "refused_by_preprocessing")
            log.warning("frame.bad", source=f.source, index=f.index, reason=str(exc), bad_frames=m.bad_frames)
            f.settled(dropped=True)
    if not frames:  # the number is spent: tell the publisher so it does not wait for it
        if turn is not None:
            pipe._turns.finish(engine, turn, "hand_over", "run")
        pipe._hand_over(pipe._results_q, Inferred(Prepared(number, [], np.empty(0), engine, [], t0, 0.0), None, 0.0))
        return
    tensor = tensors[0] if len(tensors) == 1 else np.concatenate(tensors)
    t1 = time.perf_counter_ns()
    pipe._costs.add("preprocess", time.thread_time_ns() - c0, len(frames))
    prepared = Prepared(number, frames, tensor, engine, geoms, t0, (t1 - t0) / 1e6, turn)
    if pipe._fuse_for(engine):  # this thread runs the model too: one hand-over less, no core waiting on another
        _hand_over_result(pipe, _run_model(pipe, prepared))
        return
    if turn is not None and not pipe._turns.wait(engine, "hand_over", turn, pipe._has_failed):
        pipe._count_drop("pipeline_failed", len(frames))
        return
    try:
        pipe._hand_over(pipe._prepared_q, prepared, len(frames))
    finally:
        if turn is not None:
            pipe._turns.finish(engine, turn, "hand_over")


def infer(pipe: Pipeline, index: int = 0) -> None:
    try:
        while not pipe._inf_closing.is_set():
            if index >= pipe._inf_active or (index > 0 and pipe._in_order_only()):
                pipe._inf_closing.wait(0.05)
                continue
            try:
                p = pipe._prepared_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if p is _END:
                pipe._hand_over(pipe._prepared_q, _END)  # the other workers need to see it too
                pipe._inf_closing.set()
                break
            _hand_over_result(pipe, _run_model(pipe, p))
    finally:
        pipe._hand_over(pipe._results_q, _WORKER_DONE)


def _hand_over_result(pipe: Pipeline, item: Inferred) -> None:
    """To the publisher; a failed inference was counted already."""
    pipe._hand_over(pipe._results_q, item, 0 if item.outputs is None else len(item.prepared.frames))


def _run_model(pipe: Pipeline, p: Prepared) -> Inferred:
    if p.turn is None:
        return _run_model_now(pipe, p)
    if not pipe._turns.wait(p.engine, "run", p.turn, pipe._has_failed):
        pipe._count_drop("pipeline_failed", len(p.frames))
        return Inferred(p, None, 0.0)
    try:
        return _run_model_now(pipe, p)
    finally:
        pipe._turns.finish(p.engine, p.turn, "run")


def _run_model_now(pipe: Pipeline, p: Prepared) -> Inferred:
    m = pipe.metrics
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    try:
        outputs: dict[str, np.ndarray] | None = p.engine.run(p.tensor, p.frames[0].source,
                                                              p.frames[0].captured_at, frame=p.frames[0])
        assert outputs is not None
        bad = p.engine.non_finite(outputs)
        if bad:  # NaN/inf answers are wrong answers: counted, never published
            raise NonFiniteOutput(f"non-finite values in outputs {bad}")
    except Exception as exc:  # a runtime failure on one input is counted, not fatal
        tally = pipe.tally(p.engine)
        with pipe._tally_lock:  # several workers count at once
            m.inference_errors += 1
            if isinstance(exc, NonFiniteOutput):
                tally.non_finite += 1
            else:
                tally.inference_errors += 1
        pipe._count_drop("non_finite_output" if isinstance(exc, NonFiniteOutput) else "inference_error",
                         len(p.frames))
        log.error("inference.error", error=f"{type(exc).__name__}: {exc}", errors=m.inference_errors)
        outputs = None
    wall_ns, cpu_ns = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    pipe._costs.add("inference", _inference_cost(p.engine, wall_ns, cpu_ns), len(p.frames))
    return Inferred(p, outputs, wall_ns / 1e6)
