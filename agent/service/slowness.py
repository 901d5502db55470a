"""A served variant that turns slow after boot is reported (health `audit.slow`, STATUS, the journal's
`audit.slow`, /metrics `edge_agent_degraded{reason="slow_serving"}`), not left silent.

The proof measured latency once, at boot; a variant can slow down later (a thermal throttle, a driver that
falls back to a slow path after some inferences, memory pressure). The audit thread reads the pipeline's
inference histogram (count and sum, no per-inference work added) every `interval` (a fifth of
`audit.slow_period_s`, at least 1 s): the mean inference time of each interval. The baseline is the smallest
of the engine's first three interval means (the first, while sessions warm up, is slower and drops out
unless the variant turned slow after it), so a slowdown that begins within the first intervals is not
averaged into it (one that begins within the very first interval may be); the
variant is reported slow when every interval of the last `audit.slow_period_s` had a mean over
`audit.slow_factor` x that baseline, so it is said at most `slow_period_s` plus two intervals after the
slowdown began (while frames flow), and cleared when a whole period is back under it. A machine's load
slows every variant alike; this is reported, not charged against the candidate (the proof's latency policy
and re-proof schedule judge what a loaded machine can serve).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from agent.logsetup import get_logger

log = get_logger("audit")

BASELINE_INTERVALS = 2  # intervals after the warm one; the baseline is the smallest mean of the three
MIN_RUNS = 5            # an interval with fewer inferences says nothing


class SlowWatch:
    def __init__(self, factor: float, period_s: float, clock: Callable[[], float] = time.monotonic):
        self.factor, self.period_s, self.clock = factor, period_s, clock
        self.interval = max(period_s / 5.0, 1.0)
        self.needed = max(int(round(period_s / self.interval)), 1)
        self.reset(None, None)

    def reset(self, engine: Any, histogram: Any) -> None:
        self._engine, self._hist = engine, histogram
        self._last: tuple[float, int, float] | None = None  # (time, count, sum) at the last interval's end
        self._warm = False
        self._base: list[float] = []
        self.baseline_ms: float | None = None
        self._recent: deque[float | None] = deque(maxlen=self.needed)  # interval means (None: too few runs)
        self.slow: dict[str, Any] | None = None

    def step(self, engine: Any, histogram: Any) -> dict[str, Any] | None:
        """Audit thread. Returns the report when the variant newly turned slow."""
        if engine is not self._engine or histogram is not self._hist:
            self.reset(engine, histogram)
        if engine is None or histogram is None:
            return None
        now = self.clock()
        count, total = sum(histogram.counts), histogram.sum
        if self._last is None:
            self._last = (now, count, total)
            return None
        if now - self._last[0] < self.interval:
            return None
        runs, spent = count - self._last[1], total - self._last[2]
        self._last = (now, count, total)
        mean = spent / runs if runs >= MIN_RUNS else None
        if not self._warm:  # the first interval: sessions warm up, caches fill (slower, so the minimum below
            self._warm = mean is not None  # drops it unless the variant turned slow within it)
            if mean is not None:
                self._base.append(mean)
            return None
        if self.baseline_ms is None:
            if mean is not None:
                self._base.append(mean)
                if len(self._base) >= BASELINE_INTERVALS + 1:
                    self.baseline_ms = min(self._base)
                    log.info("audit.latency_baseline", candidate=engine.candidate.key,
                             inference_ms=round(self.baseline_ms, 3), slow_factor=self.factor,
                             slow_period_s=self.period_s)
            return None
        self._recent.append(mean)
        bound = self.factor * self.baseline_ms
        full = len(self._recent) == self.needed and all(m is not None for m in self._recent)
        if self.slow is None and full and all(m > bound for m in self._recent if m is not None):
            self.slow = {"candidate": engine.candidate.key, "baseline_ms": round(self.baseline_ms, 3),
                         "recent_ms": round(mean or 0.0, 3), "ratio": round((mean or 0.0) / self.baseline_ms, 2),
                         "factor": self.factor, "period_s": self.period_s, "at_unix": round(time.time(), 3)}
            log.error("audit.slow", **self.slow, reason=f"mean inference time over {self.factor:g} x its serving "
                      f"baseline for {self.period_s:g} s")
            return self.slow
        if self.slow is not None and full and all(m is not None and m <= bound for m in self._recent):
            log.warning("audit.slow_cleared", candidate=engine.candidate.key, recent_ms=round(mean or 0.0, 3),
                        baseline_ms=round(self.baseline_ms, 3))
            self.slow = None
        return None
