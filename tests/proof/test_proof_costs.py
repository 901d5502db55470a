"""The proof's costs say where its memory goes: each part carries the process's RSS after it and its peak so far
(issue 48: the self-test child's peak, reported by the child itself)."""

from __future__ import annotations

import json

import numpy as np

from agent.proof.costs import ProofCosts


def test_each_part_records_the_resident_set_after_it_and_the_peak_so_far() -> None:
    costs = ProofCosts()
    with costs.part("small"):
        pass
    with costs.part("a 64 MB array, touched and freed"):
        a = np.ones(64 * 2**20, np.uint8)
        del a
    small, big = costs.to_list()
    assert {"rss_mb", "peak_rss_mb", "wall_ms", "cpu_ms"} <= set(small)
    assert small["rss_mb"] is not None and 0 < small["rss_mb"] <= small["peak_rss_mb"] + 1
    assert big["peak_rss_mb"] >= small["rss_mb"] + 60  # the array was resident at some point of the part
    json.dumps(costs.to_list(), allow_nan=False)  # the report stays strict JSON
