"""The self-test's named steps over one `_Run` value, in the order `run_selftest` calls them: start (golden
samples, preprocessing check, probes, candidates, crash markers), the cached winner re-checked, each provider group
proven and timed, latency re-measured, a degraded winner served, finish (reduced-decode check, report, cache).
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import onnxruntime as ort

from agent.bundle.load import Bundle, GoldenSample
from agent.fsio import read_json, write_json_atomic
from agent.hashing import sha256_bytes
from agent.logsetup import get_logger
from agent.proof.costs import ProofCosts
from agent.proof.crash_files import CACHE_FILE
from agent.proof.crash_markers import CrashMarkers
from agent.proof.evidence import ServingEvidence, applying
from agent.proof.golden_inputs import check_preprocessing, recorded_outputs, timing_tensor
from agent.proof.latency_loop import Trial, time_interleaved
from agent.proof.probe import device_fingerprint
from agent.proof.reduced_decode import (
    DECODE_PATHS,
    REDUCED_SCALES,
    check_reduced_decode,
    choosable_scale,
    decode_paths,
)
from agent.proof.selection import (
    build_candidates,
    choose,
    fastest_proven,
    latency_retry_schedule,
    provider_groups,
    should_remeasure_latency,
)
from agent.proof.selftest_options import SelftestOptions
from agent.proof.selftest_report import SelftestReport
from agent.proof.stage_proof import load_answers
from agent.proof.terms import ProviderStatus
from agent.proof.verdict import Candidate, CandidateResult, PreprocessCheck, judge

if TYPE_CHECKING:
    from agent.proof.selftest import Seams

log = get_logger("selftest")
T = TypeVar("T")


def _interleaved(markers: CrashMarkers | None, bundle: Bundle, fn: Callable[[Any], T]) -> T:
    return markers.interleaved(bundle.manifest_sha256, fn) if markers else fn(None)


def cache_key(bundle: Bundle, statuses: Sequence[ProviderStatus], opts: SelftestOptions,
              fingerprint: Mapping[str, str], skipped: Sequence[str] = ()) -> str:
    """`skipped`: the candidates this proof skips (a crash record, evidence from serving): a verdict won while a
    better candidate was skipped is not reused once that skip no longer applies."""
    material = {
        "skipped": sorted(skipped),
        "bundle": bundle.manifest_sha256,
        "onnxruntime": ort.__version__,
        "providers": [(s.name, s.usable, sorted(s.versions.items()), sorted(s.options.items())) for s in statuses],
        "device": sorted(fingerprint.items()),
        "policy": repr(opts.policy),
        "settings": repr(opts.settings),
        "max_batch": opts.max_batch,  # a verdict at batch 1 says nothing about batch 4
        "workers": opts.workers,
    }
    return sha256_bytes(json.dumps(material, sort_keys=True, default=str).encode())


@dataclass
class _Run:
    """One self-test's inputs and what its steps share: read once by `_start`, then passed along."""

    bundle: Bundle
    opts: SelftestOptions
    seams: Seams
    t0: float
    created: str
    costs: ProofCosts
    golden: list[GoldenSample]
    preprocessed: tuple[PreprocessCheck, list[np.ndarray]]
    statuses: list[ProviderStatus]
    fingerprint: dict[str, Any]
    key: str
    candidates: list[Candidate]
    notes: list[str]
    directory: Path | None
    markers: CrashMarkers | None
    crashed: dict[str, str]
    scale_bound: int  # the largest reduced decode scale a configured source can choose
    needed_paths: tuple[str, ...]  # the decode paths the configured sources use
    disproven: dict[str, ServingEvidence]  # evidence from serving a golden-only proof cannot clear (evidence.py)


def _start(bundle: Bundle, state_dir: Path | None, opts: SelftestOptions, seams: Seams) -> _Run:
    """Read what every step needs: the golden samples, the preprocessing check, the probes, the candidates,
    the crash markers."""
    t0 = time.perf_counter()
    created = datetime.now(timezone.utc).isoformat()
    m = bundle.manifest
    costs = ProofCosts()
    with costs.part("golden samples: read"):
        golden = bundle.golden()
        load_answers(bundle, len(golden))  # malformed package answers fail the bundle here, naming file and sample
    with costs.part("preprocessing check"):
        preprocessed = check_preprocessing(bundle, golden)  # the device's preprocessing: one check for all candidates
    with costs.part("provider probes"):
        statuses = seams.detect_providers(opts.provider_order, opts.provider_options, opts.settings)
    for s in statuses:
        log.info("provider.probed", provider=s.name, listed=s.listed, usable=s.usable, reason=s.reason)
    fingerprint = device_fingerprint()
    candidates, notes = build_candidates(m, statuses, opts.policy, opts.provider_options)
    directory = (state_dir / "selftest") if state_dir else None
    markers = CrashMarkers(directory) if directory else None
    # scales no configured source can choose are not proven (a 720p camera never decodes a 128x128 model's
    # frames at 1/8); a cached check bounded lower than the sources now allow is run again
    crashed = markers.recover() if markers else {}
    disproven = applying(directory, bundle, opts)
    skipped = [k for k in crashed if k.startswith(f"{bundle.manifest_sha256}|")] + list(disproven)
    return _Run(bundle, opts, seams, t0, created, costs, list(golden), preprocessed, list(statuses), fingerprint,
                cache_key(bundle, statuses, opts, fingerprint, skipped), list(candidates), list(notes), directory,
                markers, crashed, choosable_scale(opts.source_limits, m.preprocess.resize),
                tuple(decode_paths(opts.source_limits)), disproven)


def _finish(run: _Run, results: list[CandidateResult], selected: CandidateResult | None, cached: bool,
            attempts: Sequence[Mapping[str, Any]] = (), degraded: str | None = None,
            opened: Any = None, decode: Mapping[str, Any] | None = None) -> SelftestReport:
    """The winner's reduced-decode check (unless reused or skipped), the report written, the cache kept."""
    bundle, opts, costs = run.bundle, run.opts, run.costs
    if selected is not None and decode is None and opts.skip_reduced_decode is not None:
        decode = {"max_scale": 1, "reason": opts.skip_reduced_decode, "scales": [], "bound": 1}
    if selected is not None and decode is None:
        with costs.part(f"{selected.candidate.key}: reduced-decode scales up to 1/{run.scale_bound}"):
            decode = _guarded(run.markers, bundle, selected.candidate,
                              lambda: check_reduced_decode(bundle, selected.candidate, opts.settings, run.golden,
                                                           opened, max_scale=run.scale_bound, callers=opts.workers,
                                                           paths=run.needed_paths))
    report = SelftestReport(bundle, tuple(run.statuses), tuple(results), selected, tuple(run.notes), run.key, cached,
                            (time.perf_counter() - run.t0) * 1000, run.created, run.fingerprint, tuple(attempts),
                            degraded, decode, tuple(costs.to_list()))
    if selected is not None and selected.warnings:
        log.warning("selftest.selected_with_warnings", candidate=selected.candidate.key,
                    warnings=[w.text() for w in selected.warnings])
    if run.directory:
        write_json_atomic(run.directory / "report.json", report.to_dict())
        if selected is not None and not cached and degraded is None:
            write_json_atomic(run.directory / CACHE_FILE, {"key": run.key, "candidate": selected.candidate.key,
                                                           "report": report.to_dict()})
    log.info("selftest.done", bundle=bundle.identity, passed=selected is not None, cached=cached,
             selected=selected.candidate.key if selected else None, reason=report.reason,
             duration_ms=round(report.duration_ms, 1))
    return report


def _cached_winner(run: _Run) -> SelftestReport | None:
    """The cached winner, re-checked without timing (session, reproduction, fidelity): the report when it still
    passes under the same cache key, else None (and the full proof runs)."""
    bundle, opts = run.bundle, run.opts
    if not (opts.use_cache and run.directory):
        return None
    cached = read_json(run.directory / CACHE_FILE, expect=dict)
    if not cached or cached.get("key") != run.key:
        return None
    hit = next((c for c in run.candidates if c.key == cached.get("candidate") and c.key not in run.disproven), None)
    if hit is None:
        return None
    with run.costs.part(f"{hit.key}: cached verdict re-checked (session, reproduction, fidelity)"):
        quick = _guarded(run.markers, bundle, hit, lambda: run.seams.evaluate(
            bundle, hit, opts.settings, run.golden, latency=False, preprocessed=run.preprocessed,
            max_batch=opts.max_batch, workers=opts.workers))
    if not quick.passed:
        log.warning("selftest.cache_recheck_failed", candidate=hit.key, reasons=list(quick.reasons))
        return None
    log.info("selftest.cache_hit", candidate=hit.key)
    # the reduced-decode check depends on what the cache key covers: reused, not re-run, unless it was bounded
    # below a scale today's sources can choose (no "bound": every scale was tried)
    decode = (cached.get("report") or {}).get("decode")
    if not isinstance(decode, dict) or (opts.skip_reduced_decode is None and (
            int(decode.get("bound", max(REDUCED_SCALES))) < run.scale_bound
            or not set(run.needed_paths) <= set(decode.get("paths", DECODE_PATHS)))):
        decode = None  # bounded below today's scales, or a path today's sources need unproven
    return _finish(run, [quick], quick, cached=True, decode=decode)


def _skip_reason(run: _Run, c: Candidate) -> str | None:
    """Why a candidate is not tried in this proof (a crash recorded against it), or None."""
    sha = run.bundle.manifest_sha256
    if c.key in run.disproven:
        return f"skipped: {run.disproven[c.key].describe()}"
    if f"{sha}|{c.key}" in run.crashed:
        return "skipped: this candidate crashed the agent during an earlier self-test or while serving"
    if f"{sha}|*:{c.variant}" in run.crashed:
        return f"skipped: reading variant {c.variant}'s contract crashed an earlier self-test"
    return None


def _latency_settings(run: _Run) -> tuple[int, int, float | None]:
    """Warm-up runs, timed runs, and the settle margin (None: the full count, as asked by --latency-runs)."""
    m, opts = run.bundle.manifest, run.opts
    runs = opts.latency_runs or m.selftest.latency_runs
    # a count asked for (--latency-runs) is run in full; the bundle's own may stop once settled
    return m.selftest.warmup_runs, runs, None if opts.latency_runs or not opts.settle else opts.policy.prefer_margin


def _prove_groups(run: _Run) -> tuple[list[CandidateResult], dict[str, Trial], CandidateResult | None]:
    """Each provider group in priority order: its candidates proven (session, reproduction, fidelity), those
    that passed timed together, the group's winner chosen; lower groups are not tried once one wins."""
    bundle, opts, m = run.bundle, run.opts, run.bundle.manifest
    recorded = {v.name: recorded_outputs(bundle, v.name, run.golden) for v in m.variants}
    for name, rec in recorded.items():
        if rec is None:
            run.notes.append(f"variant {name}: no recorded outputs in the golden samples (bundle made before "
                             f"variant.<name>.<output>): reproduction reference=source")
    if m.selftest.parity:
        run.notes.append("selftest.parity (legacy) is not judged: reproduction and fidelity replace it")
    warmup, runs, settle = _latency_settings(run)
    results: list[CandidateResult] = []
    trials: dict[str, Trial] = {}
    selected: CandidateResult | None = None
    for group in provider_groups(run.candidates):
        if selected is not None:
            results += [CandidateResult(c, False, ("not tried: a higher-priority provider passed",), None, "not_tried")
                        for c in group]
            continue
        proven: list[Trial] = []
        skipped: dict[str, CandidateResult] = {}
        for c in group:
            why = _skip_reason(run, c)
            if why is not None:
                skipped[c.key] = CandidateResult(c, False, (why,), None, "skipped")
                continue
            log.info("selftest.candidate_start", candidate=c.key)
            with run.costs.part(f"{c.key}: session, reproduction, fidelity, batch sizes"):
                trial = _guarded(run.markers, bundle, c, functools.partial(
                    run.seams.prove, bundle, c, opts.settings, run.golden, run.preprocessed, recorded,
                    opts.max_batch, opts.workers))
            trials[c.key] = trial
            if judge(trial.evidence, m).passed:
                proven.append(trial)
        if proven:  # only candidates that answered both questions are worth timing
            # Each ran its golden samples under its own marker already; inside the interleaved loop the
            # marker switches to each candidate before each of its runs.
            with run.costs.part(f"latency: {warmup} warm-up + up to {runs} timed runs each, {len(proven)} "
                                "interleaved"):
                _interleaved(run.markers, bundle,
                             lambda mk: time_interleaved(proven, timing_tensor(run.golden), warmup, runs, manifest=m,
                                                         marker=mk, settle_margin=settle,
                                                         before_run=run.seams.before_run))
        group_results = [skipped.get(c.key) or judge(trials[c.key].evidence, m) for c in group]
        for r in group_results:
            _log_result(r)
        results += group_results
        selected = choose(group_results, opts.policy.prefer_margin)
    return results, trials, selected


def _remeasure(run: _Run, results: list[CandidateResult], trials: dict[str, Trial]
               ) -> tuple[list[CandidateResult], CandidateResult | None, list[dict[str, Any]]]:
    """Only latency failed: the slow candidates timed again on the policy's backoff schedule, until one group
    has a winner or nothing fails only on latency any more."""
    bundle, opts, m = run.bundle, run.opts, run.bundle.manifest
    warmup, runs, settle = _latency_settings(run)
    attempts: list[dict[str, Any]] = []
    selected: CandidateResult | None = None
    schedule = latency_retry_schedule(opts.policy.latency_retries, opts.policy.latency_backoff_s)
    for attempt, delay in enumerate(schedule, 1):
        slow = [trials[r.candidate.key] for r in results if r.failed_only_on_latency]
        log.warning("selftest.latency_retry", attempt=attempt, of=len(schedule), wait_s=delay,
                    candidates=[t.candidate.key for t in slow], load=round(os.getloadavg()[0], 2))
        opts.sleep(delay)
        with run.costs.part(f"latency re-measurement {attempt}"):
            _interleaved(run.markers, bundle,
                         lambda mk: time_interleaved(slow, timing_tensor(run.golden), warmup, runs, attempt,
                                                     manifest=m, marker=mk, settle_margin=settle,
                                                     before_run=run.seams.before_run))
        again = {t.candidate.key: judge(t.evidence, m) for t in slow}
        results = [again.get(r.candidate.key, r) for r in results]
        attempts.append({"attempt": attempt, "waited_s": delay,
                         "load_average": slow[0].evidence.latency_context.load_after
                         if slow[0].evidence.latency_context else None,
                         "p95_ms": {k: r.evidence.latency.p95_ms if r.evidence and r.evidence.latency else None
                                    for k, r in again.items()}})
        for group in provider_groups([r.candidate for r in results]):
            keys = {c.key for c in group}
            selected = choose([r for r in results if r.candidate.key in keys], opts.policy.prefer_margin)
            if selected is not None:
                break
        if selected is not None or not should_remeasure_latency(results):
            break
    return results, selected, attempts


def _serve_degraded(run: _Run, results: list[CandidateResult], attempts: int
                    ) -> tuple[CandidateResult | None, str | None]:
    """`selection.when_too_slow: degraded`: the fastest candidate that reproduced and kept fidelity, said."""
    best = fastest_proven(results)
    if best is None:
        return None, None
    m = run.bundle.manifest
    lat = best.evidence.latency if best.evidence else None
    degraded = (f"serving {best.candidate.key} degraded: it reproduced and kept fidelity but p95 "
                f"{lat.p95_ms if lat else float('nan'):.2f} ms stays over budget "
                f"{m.selftest.budget_for(best.candidate.provider)} ms after {attempts} "
                f"latency re-measurements (selection.when_too_slow: degraded)")
    log.warning("selftest.degraded", candidate=best.candidate.key, reason=degraded)
    return best, degraded


def _log_result(r: CandidateResult) -> None:
    level = log.info if r.passed else log.warning
    level("selftest.candidate_passed" if r.passed else "selftest.candidate_rejected",
          candidate=r.candidate.key, reasons=list(r.reasons), warnings=[w.text() for w in r.warnings],
          p50_ms=r.evidence.latency.p50_ms if r.evidence and r.evidence.latency else None)


def _guarded(markers: CrashMarkers | None, bundle: Bundle, c: Candidate, fn: Callable[[], T]) -> T:
    if markers:
        markers.enter(bundle.manifest_sha256, c)
    try:
        return fn()
    finally:
        if markers:
            markers.leave()
