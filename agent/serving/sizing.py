"""How many threads each serving stage gets, from what each stage measurably costs per frame.

Pure: the pipeline measures CPU time per frame in each stage over its first frames and asks `plan_stages`
how to spread the machine's cores. The pace the plan expects is the slowest of: the cores over the
total CPU per frame, each single-threaded stage (capture per source, the publisher), and each pool at
its size. A pool gets just enough threads for that pace; a stage that cannot be split (one capture
thread per source, one publisher) is named as the bottleneck when it is the one that sets the pace.

`fused` (the CPU provider): preprocessing and inference run in the same worker, one frame start to end.
They compete for the same cores anyway, and each hand-over between threads costs a wake-up and the
GIL: on 2 cores, two fused workers served 903 fps where a preprocessing pool feeding an inference pool
served 735 (the demo classifier on 720p MJPEG, measured). An accelerator keeps the two pools, so the
CPU prepares frames while the device runs others.

Decoder threads (H.264/H.265 through FFmpeg): FFmpeg decodes in its own frame threads, whose CPU the
pipeline counts as `other`. What bounds the decoder is how long the capture thread waits inside it per frame
(`DecoderLoad.wait_ms`, wall time, the network's time excluded): a decoder that delivers no faster than the
pace the other stages allow is given threads for HEADROOM x that pace, as a pool is, at most FFmpeg's own
choice (cores + 1), the cores' worth over all sources, and `DECODER_MEMORY_MB`. Measured on 2 cores, 720p
H.264: with 2 frame threads the planner saw "other threads 3.23 ms" and the agent served 0.86x the loop,
whose FFmpeg had 3.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StageCosts:
    """Milliseconds of CPU per frame, measured: capture is per frame of one source (its own thread)."""

    capture_ms: float
    preprocess_ms: float
    inference_ms: float
    publish_ms: float
    frames: int  # how many frames the figures are averaged over
    # the process's CPU per frame beyond the stages' own threads: FFmpeg's decoder threads, the runtime's
    # intra-op threads, the agent's other threads. Counted in the cores' limit, not in any one stage's.
    other_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.capture_ms + self.preprocess_ms + self.inference_ms + self.publish_ms + self.other_ms


@dataclass(frozen=True)
class StagePlan:
    preprocess_workers: int   # fused: the workers that preprocess and run the model
    inference_workers: int    # fused: 1, a drain for frames prepared before the plan
    pace_fps: float           # the rate the slowest stage allows, all sources together
    bottleneck: str           # the stage that sets the pace: cpu | capture | preprocess | inference | publish
    limits_fps: dict[str, float]  # each stage's own ceiling at the planned size
    costs: StageCosts | None  # None: the defaults before anything was measured
    reason: str
    fused: bool = False
    decoders: tuple["DecoderPlan", ...] = ()  # FFmpeg-decoded sources: the decoder threads each gets, and why

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON: a rate with no bound (nothing measured, a stage that costs nothing) is null."""
        out = asdict(self)
        out["limits_fps"] = {k: _fps(v) for k, v in self.limits_fps.items()}
        out["decoders"] = [{**asdict(d), "limit_fps": _fps(d.limit_fps), "wait_ms": round(d.wait_ms, 3)}
                           for d in self.decoders]
        out["pace_fps"] = _fps(self.pace_fps)
        if self.costs is not None:
            out["costs"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self.costs).items()}
        return out


@dataclass(frozen=True)
class DecoderLoad:
    """One FFmpeg-decoded source over the measured frames."""

    source: str
    threads: int    # frame threads its decoder has now
    wait_ms: float  # wall time per frame the capture thread spent inside the decoder (not waiting for packets)
    pixels: int     # frame size, for the memory bound
    fixed: bool = False  # `decoder_threads` configured: kept
    hw: bool = False     # decoded by a device: its threads are not the CPU's


@dataclass(frozen=True)
class DecoderPlan:
    source: str
    threads: int      # planned (never fewer than it has: a swap costs a keyframe's wait, and memory is the bound)
    was: int
    wait_ms: float
    limit_fps: float  # the decoder's own ceiling at `threads` (measured at `was`, scaled by threads/was)
    reason: str


# Each FFmpeg frame thread keeps a decoding context and its frames: about 25 MB at 1080p, measured (30, 56, 81,
# 106 MB for 1-4 decoders in one process). The decoders' threads together stay under DECODER_MEMORY_MB.
MB_PER_THREAD_1080P = 25.0
DECODER_MEMORY_MB = 100.0


def decoder_memory_mb(threads: int, pixels: int) -> float:
    return threads * MB_PER_THREAD_1080P * pixels / (1920 * 1080)


def plan_decoders(loads: list[DecoderLoad], *, pace_fps: float, cores: int, sources: int,
                  budget_mb: float = DECODER_MEMORY_MB) -> tuple[DecoderPlan, ...]:
    """Frame threads per decoder so none sets the pace below `pace_fps` (what the other stages allow, all
    sources together: each source's share is pace / sources). A decoder whose measured ceiling is under
    HEADROOM x its share gets threads in proportion, the most starved first, within FFmpeg's own choice for one
    stream (cores + 1), the cores' worth over all sources (cores + 1, or what they already have) and the
    memory budget. A configured count and a hardware decoder are kept; no decoder is given fewer threads."""
    cores, sources = max(cores, 1), max(sources, 1)
    share = pace_fps / sources
    total = sum(d.threads for d in loads)
    total_cap = max(cores + 1, total)
    mem = sum(decoder_memory_mb(d.threads, d.pixels) for d in loads)
    budget = max(budget_mb, mem)
    plans: dict[str, DecoderPlan] = {}

    def ceiling(d: DecoderLoad, threads: int) -> float:
        return math.inf if d.wait_ms <= 0 else 1000.0 / d.wait_ms * threads / max(d.threads, 1)

    # the most starved first: they get the cores and the memory before the others
    for d in sorted(loads, key=lambda d: ceiling(d, d.threads)):
        now = ceiling(d, d.threads)
        if math.isinf(now):
            want = d.threads  # never waited for: the decoder is not what anything waits on
        elif math.isinf(share):
            want = cores + 1  # nothing else bounds the pace: as many as FFmpeg itself would take
        else:
            want = max(d.threads, math.ceil(d.threads * share * HEADROOM / now - 1e-9))
        threads = d.threads
        if d.fixed:
            why = "configured (source.decoder_threads)"
        elif d.hw:
            why = "decoded by the device"
        elif want <= d.threads:
            why = ("never waited for" if math.isinf(now) else
                   f"delivers {now:.0f} fps at {d.threads} threads, at least {HEADROOM} x its share of the pace "
                   f"({share:.0f} fps)")
        else:
            by_mem = d.threads + max(0, int((budget - mem) // decoder_memory_mb(1, max(d.pixels, 1))))
            by_cores = d.threads + max(0, total_cap - total)
            threads = min(want, cores + 1, by_cores, by_mem)
            bound = ("" if threads == want else
                     f", capped at cores + 1 ({cores + 1})" if threads == cores + 1 else
                     f", capped by the decoders' memory budget ({budget:.0f} MB)" if threads == by_mem else
                     f", capped: the sources' decoders hold {total} threads on {cores} cores")
            why = (f"decode-bound: {now:.0f} fps at {d.threads} threads ({d.wait_ms:.2f} ms waited per frame), "
                   f"its share of the pace {share:.0f} fps: {want} wanted{bound}")
            total += threads - d.threads
            mem += decoder_memory_mb(threads - d.threads, d.pixels)
        plans[d.source] = DecoderPlan(d.source, threads, d.threads, d.wait_ms, ceiling(d, threads), why)
    return tuple(plans[d.source] for d in loads)


def _fps(v: float) -> float | None:
    return None if math.isinf(v) else round(v, 1)


def _rate(threads: int, ms: float) -> float:
    return math.inf if ms <= 0 else threads * 1000.0 / ms


HEADROOM = 1.2  # a pool sized exactly to the pace becomes the bottleneck at the first jitter


def _threads(pace_fps: float, ms: float) -> int:
    return max(1, math.ceil(pace_fps * HEADROOM * ms / 1000 - 1e-9))


def initial_plan(cores: int, preprocess_max: int, inference_max: int, fused: bool = False) -> StagePlan:
    """Before any frame is measured: every pool at its maximum, so measuring is not itself throttled."""
    if fused:
        return StagePlan(preprocess_max, 1, math.inf, "unmeasured", {}, None,
                         f"not measured yet: {preprocess_max} workers preprocessing and running the model on "
                         f"{cores} cores", True)
    return StagePlan(preprocess_max, inference_max, math.inf, "unmeasured", {}, None,
                     f"not measured yet: {preprocess_max} preprocessing and {inference_max} inference threads "
                     f"on {cores} cores")


def plan_stages(costs: StageCosts, *, cores: int, sources: int, preprocess_max: int, inference_max: int,
                in_order: bool = False, fused: bool = False, decoders: list[DecoderLoad] | None = None) -> StagePlan:
    """Threads per pool so the slowest stage sets the pace. `in_order` (a stateful model): frames must
    pass preprocessing and inference one at a time, so both pools are one thread. `fused`: one pool of
    `preprocess_max` workers does both (see the module's note). `decoders`: the FFmpeg-decoded sources, given
    threads for the pace the other stages allow (`plan_decoders`); their ceiling at the planned threads is
    the `decode` stage's."""
    cores, sources = max(cores, 1), max(sources, 1)
    pre_max, inf_max = (1, 1) if in_order else (max(preprocess_max, 1), max(inference_max, 1))
    fixed = {
        "cpu": _rate(cores, costs.total_ms),
        "capture": sources * _rate(1, costs.capture_ms),  # one thread per source, each at its own cost
        "publish": _rate(1, costs.publish_ms),
    }
    if fused:
        fixed["workers"] = _rate(pre_max, costs.preprocess_ms + costs.inference_ms)
    else:
        fixed["preprocess"] = _rate(pre_max, costs.preprocess_ms)
        fixed["inference"] = _rate(inf_max, costs.inference_ms)
    planned: tuple[DecoderPlan, ...] = ()
    if decoders:
        planned = plan_decoders(decoders, pace_fps=min(fixed.values()), cores=cores, sources=sources)
        fixed["decode"] = len(planned) * min(d.limit_fps for d in planned)  # taken in turn: the slowest bounds
    bottleneck = min(fixed, key=lambda k: fixed[k])
    pace = fixed[bottleneck]
    # Enough threads to keep up with that pace (with HEADROOM for jitter), never more than the pool may have.
    if fused:
        pre = pre_max if math.isinf(pace) else min(pre_max, _threads(pace, costs.preprocess_ms + costs.inference_ms))
        inf = 1
        limits = {**fixed, "workers": _rate(pre, costs.preprocess_ms + costs.inference_ms)}
    else:
        pre = pre_max if math.isinf(pace) else min(pre_max, _threads(pace, costs.preprocess_ms))
        inf = inf_max if math.isinf(pace) else min(inf_max, _threads(pace, costs.inference_ms))
        limits = {**fixed, "preprocess": _rate(pre, costs.preprocess_ms), "inference": _rate(inf, costs.inference_ms)}
    reason = (f"{bottleneck} sets the pace at {pace:.0f} fps "
              f"(CPU per frame: capture {costs.capture_ms:.2f} ms, preprocess {costs.preprocess_ms:.2f} ms, "
              f"inference {costs.inference_ms:.2f} ms, publish {costs.publish_ms:.2f} ms, other threads "
              f"{costs.other_ms:.2f} ms over {costs.frames} "
              f"frames; {cores} cores, {sources} source{'s' if sources > 1 else ''})"
              + (f"; {pre} workers each preprocess and run the model" if fused else "")
              + ("; frames in order (stateful model): one thread each" if in_order else "")
              + "".join(f"; decoder {d.source}: {d.threads} threads ({d.reason})" for d in planned))
    return StagePlan(pre, inf, pace, bottleneck, limits, costs, reason, fused, planned)
