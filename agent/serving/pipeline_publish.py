"""The pipeline's publish stage (agent.serving.pipeline runs it as a thread): results re-ordered by preparation
number, each frame's result decoded, timed and written to the sink and tallied for its engine, a result the post
stage or the size bound refuses counted; and the pools sized from the stage costs measured over the first results.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agent.errors import ResultTooLargeError, StageOutputError
from agent.logsetup import get_logger
from agent.serving.capabilities import Multiplexed
from agent.serving.pipeline_parts import (
    _END,
    _WORKER_DONE,
    EngineTally,
    Inferred,
    Prepared,
)
from agent.serving.sizing import StageCosts, plan_stages
from agent.serving.sources import video_sources
from agent.vocabulary.decoders import split_batch

if TYPE_CHECKING:
    from agent.serving.pipeline import Pipeline

log = get_logger("pipeline")

# Stage costs are measured over results SIZING_WARMUP+1 .. SIZING_WARMUP+SIZING_FRAMES of each engine
# (the first runs of a session are slow and would oversize the pools).
SIZING_WARMUP = 8
SIZING_FRAMES = 48


def publish(pipe: Pipeline) -> None:
    """Results in order to the sink. A failure is recorded before `done` is set: the owner takes done
    without a failure for a source that ended."""
    try:
        _publish_results(pipe)
    except BaseException as exc:
        pipe._record_failure("publish", exc)
        raise
    finally:
        try:
            pipe.sink.close()
        except BaseException as exc:
            pipe._record_failure("publish", exc)
            raise
        finally:  # a sink that cannot close fails the pipeline; it still ended
            pipe.done.set()


def _publish_results(pipe: Pipeline) -> None:
    for item in _in_order(pipe):
        try:
            _publish_item(pipe, item)
        finally:  # each frame was settled as published or dropped; a publish that raised drops the rest
            for frame in item.prepared.frames:
                frame.settled(dropped=True)


def _in_order(pipe: Pipeline) -> Any:
    """Results from all inference workers, re-ordered by preparation number."""
    pending: dict[int, Inferred] = {}
    next_number, done = 1, 0
    while done < pipe._workers:
        item = pipe._results_q.get()
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


def _publish_item(pipe: Pipeline, item: Inferred) -> None:
    m = pipe.metrics
    if item.outputs is None:  # the run failed: counted there
        for frame in item.prepared.frames:
            frame.settled(dropped=True)
        return
    p: Prepared = item.prepared
    eng = p.engine
    n = len(p.frames)
    tally = pipe.tally(eng)
    for i, frame in enumerate(p.frames):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        outs = split_batch(item.outputs, i, eng.bundle.manifest.batch_axes)
        try:
            result = eng.annotate(frame, eng.decode(outs, p.geometry[i], pipe.max_result_bytes))
        except (StageOutputError, ResultTooLargeError) as exc:  # counted, never served
            # a post graph's outputs its kind refuses, or a result too large for one message
            refused = isinstance(exc, StageOutputError)
            m.result_errors += 1
            tally.post_refused += refused
            pipe._count_drop("post_stage_refused" if refused else "result_too_large")
            log.error("result.post_stage_refused" if refused else "result.too_large", source=frame.source,
                      index=frame.index, reason=str(exc), result_errors=m.result_errors)
            frame.settled(dropped=True)
            continue
        t1 = time.perf_counter_ns()
        pipe._seq += 1
        timings = {
            "queue_ms": round((p.dequeued_ns - frame.captured_ns) / 1e6, 3),
            "preprocess_ms": round(p.preprocess_ms / n, 3),
            "inference_ms": round(item.inference_ms, 3),
            "postprocess_ms": round((t1 - t0) / 1e6, 3),
            "total_ms": round((t1 - frame.captured_ns) / 1e6, 3),
        }
        for key in ("queue", "preprocess", "inference", "postprocess", "total"):
            m.observe(key, timings[f"{key}_ms"])
        pipe.sink.write({
            "boot": pipe.boot,
            **({"instance": pipe.instance} if pipe.instance else {}),
            "seq": pipe._seq,
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
        if pipe.live is not None:
            pipe.live.served(id(frame), pipe._seq, result)
        m.frames_out += 1
        tally.results += 1
        if len(tally.inference_ms) < EngineTally.MAX_SAMPLES:
            tally.inference_ms.append(item.inference_ms)
        m.rate_out.mark()
        m.last_progress = time.monotonic()
        pipe._costs.add("publish", time.thread_time_ns() - c0)
        if eng is pipe._engine:  # after a swap, the old engine's results still in flight are not the new one's
            _size_stages(pipe)


def _size_stages(pipe: Pipeline) -> None:
    """Called by the publisher after each result: measure over the first frames, then size the pools."""
    pipe._sized_results += 1
    if pipe._sized_results == SIZING_WARMUP:
        pipe._costs.reset()
        pipe._process_ns0 = time.process_time_ns()
        pipe._decode0 = {id(v): (v.decode_meter.wait_ns, v.decode_meter.frames) for v in video_sources(pipe.source)}
        return
    if pipe._sized_results != SIZING_WARMUP + SIZING_FRAMES:
        return
    src = pipe.source
    capture = src.capture_cpu_ms() if isinstance(src, Multiplexed) else pipe._costs.per_frame_ms("capture")
    own = [pipe._costs.per_frame_ms(s) for s in ("preprocess", "inference", "publish")]
    process_ms = (time.process_time_ns() - pipe._process_ns0) / 1e6 / SIZING_FRAMES
    # each frame was captured once, by one source's thread: its capture counts once, however many sources
    other = max(0.0, process_ms - capture - sum(own))
    costs = StageCosts(capture, own[0], own[1], own[2], SIZING_FRAMES, other)
    in_order = pipe._in_order_only()
    videos = {v.name: v for v in video_sources(src)}
    loads = [load for v in videos.values() if (load := v.decoder_load(pipe._decode0.get(id(v), (0, 0))))]
    plan = plan_stages(costs, cores=pipe.cores, sources=len(src.feeds) if isinstance(src, Multiplexed) else 1,
                       preprocess_max=pipe._pre_max, inference_max=pipe._workers, in_order=in_order,
                       fused=pipe._fused, decoders=loads)
    for d in plan.decoders:  # taken by each decoder at its next keyframe
        videos[d.source].plan_decoder(d.threads, d.reason)
    # configured sizes are kept, except that a stateful model's frames go one at a time (only the first
    # thread of each pool serves them): the plan, exported as gauges, says what really runs
    if pipe._pre_fixed and not in_order:
        plan = replace(plan, preprocess_workers=pipe._pre_fixed)
    if pipe._inf_fixed and not pipe._fused and not in_order:
        plan = replace(plan, inference_workers=pipe._inf_fixed)
    pipe.plan = plan
    pipe._pre_active, pipe._inf_active = plan.preprocess_workers, plan.inference_workers
    log.info("pipeline.stages_sized", preprocess_workers=plan.preprocess_workers,
             inference_workers=plan.inference_workers, bottleneck=plan.bottleneck,
             pace_fps=round(plan.pace_fps, 1), reason=plan.reason,
             decoder_threads={d.source: d.threads for d in plan.decoders} or None)
