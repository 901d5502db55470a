"""The self-test's latency loop: every open candidate timed in round-robin (one run each per round), so a
burst of load on a busy machine lands on all alike, stopping early once the answer cannot change."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from agent.proof.selection import may_settle, samples_settled
from agent.proof.terms import LatencyStats
from agent.proof.verdict import Candidate, Evidence, LatencyContext
from agent.vocabulary.inputs import InputFeeder


@dataclass
class Trial:
    """A candidate between its correctness checks and its latency: the open session stays so that
    the timing of all candidates can be interleaved."""

    candidate: Candidate
    evidence: Evidence
    opened: Any = None


def _timed_call(opened: Any, m: Any, tensor: np.ndarray) -> Callable[[], Any]:
    """One inference with the feeds serving gives it (the first step, for a sequence)."""
    feeds = InputFeeder.for_manifest(m).feeds(tensor, "selftest")
    return lambda: opened.session.run(None, feeds)


def time_interleaved(trials: Sequence[Trial], tensor: np.ndarray, warmup: int, runs: int,
                     attempt: int = 0, manifest: Any = None, marker: Any = None,
                     settle_margin: float | None = None,
                     before_run: Callable[[Candidate, int], None] | None = None) -> None:
    """Time every open trial in round-robin (one run each per round), so a burst of load on a busy
    machine lands on all candidates alike; the load average is recorded beside the figures.

    `marker` (a `RunMarker`) is switched to each candidate before each of its runs, outside the timed
    region: a crash on the 30th run of one candidate is blamed on that candidate, not on the first.

    `settle_margin` (the selection's prefer_margin; None: always the full count): stop before `runs` once
    the answer cannot change (`selection.latency_settled`), once `selection.may_settle` allows the question
    (SETTLE_MIN_RUNS rounds that took SETTLE_AFTER_S of timed runs, or SETTLE_FAST_RUNS rounds); the context
    says so.

    `before_run` is called inside the timed region before every run with the candidate and its run number
    (1-based, warm-up included): the self-test child's fault hook (`run:<provider>:<variant>#N`)."""
    live = [t for t in trials if t.opened is not None and t.evidence.error is None]
    if not live:
        return
    samples: dict[int, list[int]] = {id(t): [] for t in live}
    count: dict[int, int] = {id(t): 0 for t in live}
    before = os.getloadavg()[0]

    def enter(t: Trial) -> None:
        count[id(t)] += 1
        if marker is not None:
            marker.set(t.candidate.key, f"latency run {count[id(t)]} of {warmup + runs}"
                       + (f", re-measurement {attempt}" if attempt else ""))

    def hook(t: Trial) -> None:  # inside the timed region: a test's slow-down fault must count
        if before_run is not None:
            before_run(t.candidate, count[id(t)])

    try:
        calls: dict[int, Callable[[], Any]] = {
            id(t): (_timed_call(t.opened, manifest, tensor) if manifest is not None else
                    functools.partial(t.opened.run, tensor)) for t in live}
        for _ in range(warmup):
            for t in live:
                enter(t)
                hook(t)
                calls[id(t)]()
        # what the stop rule needs, or None: the full count
        settle = ((settle_margin, [manifest.selftest.budget_for(t.candidate.provider) for t in live])
                  if manifest is not None and settle_margin is not None else None)
        timed_ns, settled = 0, None
        for done in range(1, runs + 1):
            for t in live:
                enter(t)
                t0 = time.perf_counter_ns()
                hook(t)
                calls[id(t)]()
                samples[id(t)].append(ns := time.perf_counter_ns() - t0)
                timed_ns += ns
            if settle is not None and may_settle(done, runs, timed_ns / 1e9):
                margin, budgets = settle
                why = samples_settled([[ns / 1e6 for ns in samples[id(t)]] for t in live], budgets, margin,
                                      [t.candidate.provider for t in live])
                if why is not None:
                    settled = f"stopped after {done} of {runs} timed runs: {why}"
                    break
    except Exception as exc:
        for t in live:
            t.evidence = replace(t.evidence, error=f"inference error during timing: {type(exc).__name__}: {exc}"[:400])
        return
    ctx = LatencyContext(round(before, 2), round(os.getloadavg()[0], 2), os.cpu_count() or 1, attempt, len(live) > 1,
                         runs, settled)
    for t in live:
        t.evidence = replace(t.evidence, latency=LatencyStats.from_ns(samples[id(t)]), latency_context=ctx)
