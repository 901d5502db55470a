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

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON: a rate with no bound (nothing measured, a stage that costs nothing) is null."""
        out = asdict(self)
        out["limits_fps"] = {k: _fps(v) for k, v in self.limits_fps.items()}
        out["pace_fps"] = _fps(self.pace_fps)
        if self.costs is not None:
            out["costs"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self.costs).items()}
        return out


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
                in_order: bool = False, fused: bool = False) -> StagePlan:
    """Threads per pool so the slowest stage sets the pace. `in_order` (a stateful model): frames must
    pass preprocessing and inference one at a time, so both pools are one thread. `fused`: one pool of
    `preprocess_max` workers does both (see the module's note)."""
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
              + ("; frames in order (stateful model): one thread each" if in_order else ""))
    return StagePlan(pre, inf, pace, bottleneck, limits, costs, reason, fused)
