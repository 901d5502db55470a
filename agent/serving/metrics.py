"""Serving metrics: counters, frame rates, rolling latency percentiles and cumulative latency
histograms per stage.

Each counter has one writer (the stage that owns it); readers take snapshots. No locks on the hot path.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent.quantiles import percentiles

STAGES = ("queue", "preprocess", "inference", "postprocess", "total")
# Upper bounds of the cumulative latency histogram (ms): from sub-millisecond CPU inference to a
# multi-second stall; /metrics exports them in seconds.
LATENCY_BUCKETS_MS: tuple[float, ...] = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2500, 5000)


class Rate:
    """Events per second over a sliding window of recent event times."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.times: deque[float] = deque(maxlen=4096)

    def mark(self, now: float | None = None) -> None:
        self.times.append(time.monotonic() if now is None else now)

    def per_second(self) -> float:
        now = time.monotonic()
        times = [t for t in list(self.times) if now - t <= self.window_s]
        if len(times) < 2:
            return 0.0
        span = max(now - times[0], 1e-9)
        return len(times) / span


class Histogram:
    """Counts per bucket (not cumulative; the last slot is +Inf) and the sum, since the pipeline started."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_MS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[float, int]], float]:
        """[(upper bound, count <= bound)...] ending with (inf, total), and the sum: a consistent copy."""
        counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            acc += n
            out.append((bound, acc))
        return out, total


@dataclass
class PipelineMetrics:
    started: float = field(default_factory=time.monotonic)
    frames_in: int = 0
    frames_out: int = 0
    dropped: int = 0  # latest-frame-wins overwrites
    bad_frames: int = 0
    inference_errors: int = 0
    result_errors: int = 0  # decoded results over output.max_result_bytes, not published
    last_progress: float = field(default_factory=time.monotonic)  # the watchdog's view: results still flowing
    last_capture: float = 0.0  # when the source last delivered a frame
    rate_in: Rate = field(default_factory=Rate)
    rate_out: Rate = field(default_factory=Rate)
    latency_ms: dict[str, deque] = field(default_factory=lambda: {s: deque(maxlen=2048) for s in STAGES})
    histograms_ms: dict[str, Histogram] = field(default_factory=lambda: {s: Histogram() for s in STAGES})

    def observe(self, stage: str, ms: float) -> None:
        self.latency_ms[stage].append(ms)
        self.histograms_ms[stage].observe(ms)

    def percentiles(self) -> dict[str, dict[str, float]]:
        out = {}
        for stage, values in self.latency_ms.items():
            if values:
                p50, p95, p99 = percentiles(list(values), (50, 95, 99))
                out[stage] = {"p50": round(p50, 3), "p95": round(p95, 3), "p99": round(p99, 3)}
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            "frames_in": self.frames_in,
            "frames_out": self.frames_out,
            "dropped": self.dropped,
            "bad_frames": self.bad_frames,
            "inference_errors": self.inference_errors,
            "result_errors": self.result_errors,
            "fps_in": round(self.rate_in.per_second(), 2),
            "fps_out": round(self.rate_out.per_second(), 2),
            "latency_ms": self.percentiles(),
            "seconds_since_progress": round(time.monotonic() - self.last_progress, 3),
        }
