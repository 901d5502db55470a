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
    any value is NaN; ValueError when there are none or `q` is out of range."""
    return percentiles(values, (q,))[0]


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """`percentile` at each of `qs`, the values sorted once."""
    s = sorted(float(v) for v in values)
    if not s:
        raise ValueError("percentile of no values")
    if any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles must be in the range [0, 100], got {list(qs)}")
    if any(math.isnan(v) for v in s):
        return [math.nan for _ in qs]
    return [_linear(s, q) for q in qs]


def _linear(s: Sequence[float], q: float) -> float:
    # numpy's steps, kept for equal bits at the ends too (an infinite or signed-zero end value): the virtual
    # index (n - 1) * q/100; at or past the last index both neighbours are the last value and the weight is
    # the index minus -1 (numpy's clipped "previous"); then `_lerp`, which computes from the upper neighbour
    # for weights >= 0.5 (b - (b - a) * (1 - t)).
    n = len(s)
    v = (n - 1) * (q / 100)
    if v >= n - 1:
        lo = hi = n - 1
        t = v + 1
    else:
        lo = math.floor(v)
        hi, t = lo + 1, v - lo
    a, b = s[lo], s[hi]
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t
