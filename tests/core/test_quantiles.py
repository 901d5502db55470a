"""The proof's percentiles (`agent.quantiles`) equal numpy.percentile's bit for bit: a latency verdict near
its budget must not move because the sort moved out of numpy."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from agent.quantiles import percentile, percentiles


def test_percentiles_equal_numpys_bit_for_bit_on_random_latency_samples() -> None:
    rng = random.Random(7)
    for _ in range(20000):
        n = rng.randint(1, 60)
        kind = rng.random()
        if kind < 0.3:  # integers in ns turned into ms, as the latency loop records them
            xs = [rng.randint(10_000, 50_000_000) / 1e6 for _ in range(n)]
        elif kind < 0.6:  # repeated values and ties
            xs = [float(rng.choice([1.0, 1.5, 2.25, 1e-3])) for _ in range(n)]
        else:
            xs = [rng.lognormvariate(0, 2) for _ in range(n)]
        qs = [50, 95, 99, 10, 0, 100, rng.uniform(0, 100)]
        want = [float(v) for v in np.percentile(np.asarray(xs, dtype=np.float64), qs)]
        assert percentiles(xs, qs) == want, (xs, qs)


def test_the_ends_equal_numpys_with_infinities_signed_zeros_and_overflow() -> None:
    """Found by review: a shortcut that returned the end value gave -inf, inf and -0.0 where numpy interpolates
    to nan and 0.0."""
    inf = math.inf
    cases = [([-inf, 1.0], 0), ([1.0, inf], 0), ([1.0, 2.0, inf], 100), ([inf], 50), ([inf], 95), ([-0.0, 1.0], 0),
             ([-1e308, 1e308], 0), ([-1e308, 1e308], 50), ([5.0], 0), ([5.0], 100), ([-0.0], 50), ([-inf, inf], 50)]
    for xs, q in cases:
        with np.errstate(all="ignore"):  # numpy's own inf - inf, said as a warning
            want = float(np.percentile(np.asarray(xs, dtype=np.float64), q))
        got = percentile(xs, q)
        assert (math.isnan(want) and math.isnan(got)) or (got == want and math.copysign(1, got) == math.copysign(1, want)), \
            (xs, q, got, want)
    with pytest.raises(ValueError, match="range"):
        percentile([1.0], 101)


def test_a_nan_sample_gives_nan_as_numpy_does_and_no_samples_is_an_error() -> None:
    with np.errstate(all="ignore"):
        assert math.isnan(float(np.percentile([1.0, math.nan, 3.0], 50)))
    assert math.isnan(percentile([1.0, math.nan, 3.0], 50))
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_the_proof_child_never_imports_numpy_ma_for_its_latency_figures() -> None:
    """numpy.percentile's first call imports numpy.ma (17 ms of a cold boot's critical path)."""
    import subprocess
    import sys

    code = ("import sys; from agent.proof.terms import LatencyStats; "
            "from agent.proof.selection import samples_settled; "
            "LatencyStats.from_ns([1000000, 2000000, 1500000]); "
            "samples_settled([[1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0]], [100.0, 100.0], 1.1, ['CPUExecutionProvider'] * 2); "
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
