"""Percentiles of short lists, equal to `numpy.percentile`'s default (linear) method bit for bit.

Why not numpy's: `np.percentile` sorts through `np.unique`, whose first call imports `numpy.ma` (17 ms of
the self-test child's start, on the cold boot's critical path), and costs 20-30 us a call where the latency
loop's stop rule asks every round. Latency samples are tens of floats, so a sort in Python is cheaper.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, as `float(numpy.percentile(values, q))` gives it: NaN when
    any value is NaN; ValueError when there are none."""
    return percentiles(values, (q,))[0]


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """`percentile` at each of `qs`, the values sorted once."""
    s = sorted(float(v) for v in values)
    if not s:
        raise ValueError("percentile of no values")
    if any(math.isnan(v) for v in s):
        return [math.nan for _ in qs]
    return [_linear(s, q) for q in qs]


def _linear(s: Sequence[float], q: float) -> float:
    # numpy: virtual index (n - 1) * q/100, clipped to the ends, then `_lerp` -- which computes from the
    # upper neighbour for weights >= 0.5 (b - (b - a) * (1 - t)), so both formulas are kept for equal bits
    n = len(s)
    v = (n - 1) * (q / 100)
    if v >= n - 1:
        return s[-1]
    if v <= 0:
        return s[0]
    lo = math.floor(v)
    a, b, t = s[lo], s[lo + 1], v - lo
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t
