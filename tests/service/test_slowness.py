"""The slow-serving watch on its own (agent/service/slowness.py): a stepped clock and the pipeline's own
histogram type; the baseline, the sustained period, and the clearing."""

from __future__ import annotations

from types import SimpleNamespace

from agent.serving.metrics import Histogram
from agent.service.slowness import SlowWatch


def _feed(watch: SlowWatch, engine: object, hist: Histogram, now: list[float], ms: float, seconds: int) -> list:
    found = []
    for _ in range(seconds):
        for _ in range(20):
            hist.observe(ms)
        now[0] += 1.0
        r = watch.step(engine, hist)
        if r is not None:
            found.append((now[0], r))
    return found


def test_reported_after_one_sustained_period_and_cleared_after_another() -> None:
    now = [0.0]
    watch = SlowWatch(3.0, 5.0, clock=lambda: now[0])
    engine, hist = SimpleNamespace(candidate=SimpleNamespace(key="CPU:int8")), Histogram()
    watch.step(engine, hist)
    assert _feed(watch, engine, hist, now, 2.0, 10) == [] and watch.baseline_ms == 2.0
    slowed_at = now[0]
    found = _feed(watch, engine, hist, now, 10.0, 10)
    assert len(found) == 1 and found[0][0] - slowed_at <= 5.0 + 1.0
    assert found[0][1]["ratio"] == 5.0 and watch.slow is not None
    assert _feed(watch, engine, hist, now, 2.0, 6) == [] and watch.slow is None


def test_a_short_stall_is_not_reported_and_a_new_engine_starts_again() -> None:
    now = [0.0]
    watch = SlowWatch(3.0, 5.0, clock=lambda: now[0])
    engine, hist = SimpleNamespace(candidate=SimpleNamespace(key="CPU:int8")), Histogram()
    watch.step(engine, hist)
    _feed(watch, engine, hist, now, 2.0, 5)
    _feed(watch, engine, hist, now, 20.0, 4)  # four seconds: shorter than the period
    assert _feed(watch, engine, hist, now, 2.0, 5) == [] and watch.slow is None
    other = SimpleNamespace(candidate=SimpleNamespace(key="CPU:fp32"))
    watch.step(other, hist)
    assert watch.baseline_ms is None
