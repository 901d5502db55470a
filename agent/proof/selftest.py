"""The boot-time self-test: probe providers, try candidates, judge each on this device, pick one.

The shell around `verdict` and `selection`: it opens real sessions, runs the golden samples and the
latency loop, writes a crash marker before each candidate, caches verdicts, and writes the report.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import onnxruntime as ort

from agent import __version__
from agent.bundle.load import Bundle, GoldenSample
from agent.fsio import read_json, write_json_atomic
from agent.hashing import sha256_bytes
from agent.logsetup import get_logger
from agent.npio import open_npz
from agent.proof.evidence import ServingEvidence, applying
from agent.proof.parity import fidelity_floors, judge_fidelity, judge_reproduction, reproduction_bounds
from agent.proof.pre_compare import Levels, SampleDiff, compare, explain, lattice_levels
from agent.proof.probe import detect_providers, device_fingerprint
from agent.proof.selection import (
    build_candidates,
    choose,
    fastest_proven,
    latency_retry_schedule,
    provider_groups,
    should_remeasure_latency,
)
from agent.proof.session import open_session
from agent.proof.stage_proof import (
    golden_geometries,
    judge_final_fidelity,
    judge_post_reproduction,
    judge_size_probes,
    load_answers,
    recorded_post,
    used_outputs,
)
from agent.proof.stages import GraphPostprocessor, postprocessor_for, preprocessor_for
from agent.proof.terms import ProviderStatus, SessionSettings
from agent.proof.verdict import (Candidate, CandidateResult, Evidence, PreprocessCheck, judge,
                                 json_safe)
from agent.vocabulary.batch_axis import check_single_sample_outputs
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.preprocess import Preprocessor

from agent.proof.crash_files import CACHE_FILE
from agent.proof.costs import ProofCosts
from agent.proof.selftest_options import (  # noqa: F401 (names callers import from here)
    SelftestOptions,
    no_reduced_decode,
    options_from_config,
    serving_workers,
    source_scale_limits,
    video_frame_size,
    video_header,
)
from agent.proof.reduced_decode import (  # noqa: F401 (names callers import from here)
    DECODE_PATHS,
    REDUCED_SCALES,
    SourceScaleLimit,
    check_reduced_decode,
    choosable_scale,
    decode_paths,
)
from agent.proof.replay import golden_steps, is_sequence, run_golden
from agent.proof.latency_loop import Trial, time_interleaved
from agent.proof.crash_markers import CrashMarkers
from agent.proof.serving_shapes import (  # noqa: F401 (tests import batch_sizes here)
    batch_sizes, judge_batches, judge_concurrent, run_concurrently,
)

log = get_logger("selftest")
T = TypeVar("T")

REPORT_SCHEMA = 1


@dataclass(frozen=True)
class SelftestReport:
    bundle: Bundle
    providers: tuple[ProviderStatus, ...]
    results: tuple[CandidateResult, ...]
    selected: CandidateResult | None
    notes: tuple[str, ...]
    cache_key: str
    cached: bool
    duration_ms: float
    created: str
    fingerprint: Mapping[str, str]
    latency_attempts: tuple[Mapping[str, Any], ...] = ()
    degraded: str | None = None
    decode: Mapping[str, Any] | None = None  # the reduced-scale decode check of the selected candidate
    costs: tuple[Mapping[str, Any], ...] = ()  # wall and CPU ms of each part of the proof (agent.proof.costs)

    @property
    def decode_max_scale(self) -> int:
        """The largest JPEG decode scale the winning candidate was proven at (1: full-size decode only)."""
        return int((self.decode or {}).get("max_scale", 1))

    @property
    def warnings(self) -> list[str]:
        """What an operator must see although something serves: a pinned below-floor variant, a
        device too slow for the budget."""
        out = [w.text() for w in self.selected.warnings] if self.selected is not None else []
        return out + ([self.degraded] if self.degraded else [])

    @property
    def too_slow(self) -> bool:
        """Nothing proven serves at full speed only because of latency: the one failure a later run on
        a quieter machine can clear (a controller re-runs the self-test on this)."""
        return self.degraded is not None or (self.selected is None and should_remeasure_latency(self.results))

    @property
    def reason(self) -> str | None:
        if self.selected is not None:
            return None
        tested = [r for r in self.results if r.status != "not_tried"]
        if not tested:
            return "no candidate to try: " + ("; ".join(self.notes) or "no usable provider has a variant")
        return "no candidate passed: " + "; ".join(f"{r.candidate.key}: {r.reasons[0]}" for r in tested if r.reasons)

    def to_dict(self) -> dict[str, Any]:
        m = self.bundle.manifest
        sel = self.selected
        return json_safe({
            "schema": REPORT_SCHEMA,
            "created": self.created,
            "agent_version": __version__,
            "bundle": {"name": m.name, "version": m.version, "label": m.label,
                       "manifest_sha256": self.bundle.manifest_sha256, "path": str(self.bundle.root)},
            "versions": {"onnxruntime": ort.__version__, "numpy": np.__version__, "python": platform.python_version()},
            "device": dict(self.fingerprint),
            "providers": [p.to_dict() for p in self.providers],
            "candidates": [r.to_dict() for r in self.results],
            "notes": list(self.notes),
            "selected": None if sel is None else {
                "provider": sel.candidate.provider, "variant": sel.candidate.variant,
                "precision": sel.candidate.precision,
                "effective_providers": list(sel.evidence.effective) if sel.evidence else [],
            },
            "passed": sel is not None,
            "reason": self.reason,
            "warnings": self.warnings,
            "degraded": self.degraded,
            "too_slow": self.too_slow,
            "pinned_below_floor": sel.candidate.pinned_below_floor if sel else None,
            "latency_attempts": [dict(a) for a in self.latency_attempts],
            "decode": dict(self.decode) if self.decode is not None else None,
            "costs": [dict(c) for c in self.costs],
            "cpu_ms": round(sum(float(c.get("cpu_ms", 0)) for c in self.costs), 1),
            "cached": self.cached,
            "cache_key": self.cache_key,
            "duration_ms": round(self.duration_ms, 1),
        })


def check_preprocessing(bundle: Bundle, golden: Sequence[GoldenSample]) -> tuple[PreprocessCheck, list[np.ndarray]]:
    """Run the device's preprocessing on each golden raw frame and compare with the bundled tensor: exact, the
    image library's rounding (agent.proof.pre_compare), or another preprocessing with the key that explains it."""
    pre = preprocessor_for(bundle)
    steps = pre.source_steps() if isinstance(pre, Preprocessor) else None
    levels = Levels(*steps) if steps is not None else None
    if not isinstance(pre, Preprocessor) and bundle.manifest.frame.kind == "image" and golden:
        # a pre graph keeps its scale, mean and std inside: one level is the grid its bundled tensor sits on (its
        # float Resize + Round moved 1-2 values a level on arm64); a tensor on no 8-bit grid stays exact
        levels = lattice_levels(golden[0].input)
    st = bundle.manifest.selftest
    worst: SampleDiff | None = None
    worst_i, tensors, rounding, explanation = 0, [], True, ""
    for g in golden:
        t = np.stack([pre(r) for r in g.raw]) if is_sequence(g) else pre(g.raw)
        tensors.append(t)
        d = compare(t, g.input, levels, st.preprocess_max_abs)
        refused = d.max_abs > st.preprocess_max_abs and not d.within(st.preprocess_rounding_levels)
        # beyond rounding, the worst refused sample is named with its own explanation (never one that only rounds)
        if refused and (rounding or worst is None or d.max_abs > worst.max_abs):
            rounding, explanation, worst, worst_i = False, explain(t, g.input, levels), d, g.index
        elif rounding and (worst is None or d.max_abs > worst.max_abs):
            worst, worst_i = d, g.index
    if worst is None:
        return PreprocessCheck(0.0, 0), tensors
    return PreprocessCheck(worst.max_abs, worst_i, worst.differing, worst.max_levels, worst.bias_levels,
                           rounding and worst.max_abs > st.preprocess_max_abs, explanation), tensors


def recorded_outputs(bundle: Bundle, variant: str,
                     golden: Sequence[GoldenSample] | None = None) -> list[dict[str, np.ndarray]] | None:
    """The variant's own outputs on each golden sample as `bundle create` recorded them
    (`variant.<name>.<output>`), or None when the bundle predates them (reproduction then falls
    back to the source references: `reproduction.against = "source"`). From `golden` when the samples
    are loaded already (they carry these arrays): each sample file is read once per proof, not once
    more per variant."""
    m = bundle.manifest
    if golden is not None:
        have = [g.variant_outputs.get(variant, {}) for g in golden]
        if not all(n in h for h in have for n in m.output_names):
            return None
        return [{n: h[n] for n in m.output_names} for h in have]
    out: list[dict[str, np.ndarray]] = []
    for rel in m.golden:
        with open_npz(bundle.path(rel)) as z:
            keys = {n: f"variant.{variant}.{n}" for n in m.output_names}
            if not all(k in z.files for k in keys.values()):
                return None
            out.append({n: z[k] for n, k in keys.items()})
    return out


def prove(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
          preprocessed: tuple[PreprocessCheck, list[np.ndarray]] | None = None,
          recorded: Mapping[str, list[dict[str, np.ndarray]] | None] | None = None,
          max_batch: int = 1, workers: int = 1) -> Trial:
    """Open the candidate's session and answer the two questions; any failure becomes evidence."""
    m = bundle.manifest
    model = bundle.path(m.variant(c.variant).file)
    try:
        opened = open_session(model, c.provider, c.options, settings, sample=golden[0].input)
    except Exception as exc:  # provider/ORT errors of every kind are a failed candidate
        return Trial(c, Evidence(c, error=f"session creation error: {type(exc).__name__}: "
                                           f"{' '.join(str(exc).split())[:400]}"))
    pre_check, tensors = preprocessed or check_preprocessing(bundle, golden)
    try:
        # End to end (device preprocessing) when preprocessing holds; the bundled tensors otherwise,
        # so a model fault is still told apart from a preprocessing fault.
        use_device = pre_check.max_abs <= m.selftest.preprocess_max_abs
        own_batched = (recorded or {}).get(c.variant) if recorded is not None else recorded_outputs(bundle, c.variant,
                                                                                                     golden)
        fed = [t if use_device else g.input for t, g in zip(tensors, golden)]
        plain = not any(is_sequence(g) for g in golden) and not m.stateful
        sizes = batch_sizes(bundle, max_batch) if plain else ()
        # Serving's own way first: with recorded outputs to judge against, the one golden pass runs from as
        # many callers as serving has (each at least one sample), so a wrong answer that needs concurrent
        # callers is caught by the reproduction itself, and one sample runs alone besides. (A second pass
        # from concurrent callers after the lone one doubled the golden runs: 4.5 of a U2-Net-p proof's
        # 10.3 s.) Micro-batches and fewer samples than callers: the lone pass, then `judge_concurrent`.
        concurrent = plain and workers > 1 and not sizes and own_batched is not None and len(fed) >= workers
        bounds = reproduction_bounds(c.precision, c.provider, m.selftest.reproduction)

        def golden_pass(together: bool) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, int | None]]]:
            if together:
                by_sample = dict(run_concurrently(opened, m, fed, workers))  # each sample once, every caller busy
                return [by_sample[i] for i in range(len(fed))], [(g.index, None) for g in golden]
            return golden_pass_of(opened, m, fed, golden)

        got, origin = golden_pass(concurrent)  # origin, per judged row: (golden sample, step of its sequence)
        if plain and golden:  # a bundle made before outputs[].batch_axis: a time-major head is named, not sliced
            used = set(m.used_outputs)
            check_single_sample_outputs({k: v for k, v in golden[0].outputs.items() if k in used}, m.batch_axes,
                                        f"golden sample {golden[0].index}")
        refs = [r for g in golden for r in golden_steps(g.outputs, is_sequence(g), m.batch_axes)]
        own = [] if own_batched is None else [r for i, g in enumerate(golden)
                                              for r in golden_steps(own_batched[i], is_sequence(g), m.batch_axes)]
        got_used, own_used, refs_used = used_outputs(m, got, own, refs)  # outputs not in postprocess.uses: never judged
        concurrent_findings: list[Any] = []
        if own_batched is not None:
            rep = judge_reproduction(m.postprocess, got_used, own_used, bounds, "variant")
            if concurrent and rep.passed:
                # serving at light load runs one caller at a time: one sample alone is judged too
                alone, = used_outputs(m, [split_batch(o, 0, m.batch_axes)
                                          for o in run_golden(opened, m, fed[0], False)])
                concurrent_findings = list(judge_reproduction(m.postprocess, alone, own_used[:1], bounds, "variant",
                                                              stage="one caller alone").findings)
            elif concurrent:
                # Which fault: the whole set alone, judged as before. Wrong only from concurrent callers: the
                # concurrent outputs' own findings, named so (stage "N concurrent callers") -- they are what
                # serving produces, so they are never judged merely against the lone outputs.
                together_used = got_used
                got, origin = golden_pass(False)
                got_used, = used_outputs(m, got)
                rep = judge_reproduction(m.postprocess, got_used, own_used, bounds, "variant")
                if rep.passed:
                    concurrent_findings = list(judge_reproduction(
                        m.postprocess, together_used, own_used, bounds, "variant",
                        stage=f"{workers} concurrent callers").findings)
        else:
            # no recorded outputs: FP32 is held to its tensor bound against the source; reduced
            # precisions only to decoded agreement (their own outputs were never recorded)
            rep = judge_reproduction(m.postprocess, got_used, refs_used, bounds, "source",
                                     tensor_bound=c.precision == "fp32")
        floors = fidelity_floors(m.task, m.selftest.fidelity)
        # The model is proven on the bundled tensors; where this device's image library rounds differently, the
        # task is judged on what it will serve: its own tensors through the same candidate.
        fid_got = used_outputs(m, golden_pass_of(opened, m, tensors, golden)[0])[0] if pre_check.rounding else got_used
        if any(is_sequence(g) for g in golden):
            fid = judge_fidelity(m.postprocess, fid_got, refs_used, floors)
        else:  # the final served result: pre stage -> this candidate -> post stage -> result kind
            post = postprocessor_for(bundle)
            pre = preprocessor_for(bundle)  # one pre stage session for the geometries and the size probes
            geoms = golden_geometries(pre, golden)
            if isinstance(post, GraphPostprocessor):
                more_rep = judge_post_reproduction(m, post, got, geoms, recorded_post(golden, c.variant), bounds)
                rep = replace(rep, findings=rep.findings + tuple(more_rep))
            fid = judge_final_fidelity(m, post, fid_got, refs_used, geoms, load_answers(bundle, len(golden)), floors)
            rep = replace(rep, findings=rep.findings + tuple(judge_size_probes(
                opened, m, c.variant, golden, bounds, pre, tensor_bound=not pre_check.rounding)))
        if pre_check.rounding:
            fid = replace(fid, findings=tuple(replace(f, detail="on this device's own preprocessing, which rounds "
                                                      "differently from the bundle's" + (f"; {f.detail}" if f.detail else ""))
                                              for f in fid.findings))
        rep, fid = _locate(rep, origin), _locate(fid, origin)
        if concurrent:  # judged above, with the reproduction itself
            more = concurrent_findings
        else:
            more = judge_batches(opened, m, fed, got, sizes, bounds) if sizes else []
            if not more and plain and workers > 1:
                more = judge_concurrent(opened, m, fed, got, workers, bounds)
        if more:
            rep = replace(rep, findings=rep.findings + tuple(more))
    except Exception as exc:
        return Trial(c, Evidence(c, error=f"inference error: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}",
                                  effective=opened.effective, placement=opened.placement))
    ev = Evidence(c, None, opened.effective, opened.placement, pre_check, rep, fid, None, None, opened.create_ms,
                  tuple(opened.ort_log))
    return Trial(c, ev, opened)


def golden_pass_of(opened: Any, m: Any, fed: Sequence[np.ndarray], golden: Sequence[GoldenSample],
                   ) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, int | None]]]:
    """Each golden tensor through the open session, one caller: the rows judged (a sequence's steps each) and,
    per row, its golden sample and step."""
    rows_of = [[split_batch(o, 0, m.batch_axes) for o in run_golden(opened, m, x, is_sequence(g))]
               for x, g in zip(fed, golden)]
    return ([r for rows in rows_of for r in rows],
            [(g.index, s if is_sequence(g) else None) for rows, g in zip(rows_of, golden) for s in range(len(rows))])


def _locate(q: Any, origin: Sequence[tuple[int, int | None]]) -> Any:
    """Findings of a stateful model name the golden sample and the step of its sequence, not the row
    of all steps flattened (which names no sample that exists)."""
    def fix(f: Any) -> Any:
        if f.sample is None or not 0 <= f.sample < len(origin) or origin[f.sample][1] is None:
            return f
        index, step = origin[f.sample]
        return replace(f, sample=index, detail=f"step {step} of its sequence" + (f"; {f.detail}" if f.detail else ""))

    return replace(q, findings=tuple(fix(f) for f in q.findings))


def _timing_tensor(golden: Sequence[GoldenSample]) -> np.ndarray:
    g = golden[0]
    return g.input[0] if is_sequence(g) else g.input


def evaluate(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
             latency: bool = True, latency_runs: int | None = None,
             preprocessed: tuple[PreprocessCheck, list[np.ndarray]] | None = None,
             max_batch: int = 1, workers: int = 1,
             before_run: Callable[[Candidate, int], None] | None = None) -> CandidateResult:
    """One candidate alone: the two questions, then (optionally) its latency. Never raises."""
    m = bundle.manifest
    trial = prove(bundle, c, settings, golden, preprocessed, max_batch=max_batch, workers=workers)
    if latency:
        time_interleaved([trial], _timing_tensor(golden), m.selftest.warmup_runs,
                         latency_runs or m.selftest.latency_runs, manifest=m, before_run=before_run)
    return judge(trial.evidence, m)


@dataclass(frozen=True)
class Seams:
    """The steps a caller may put something in front of, passed in as values (never by rebinding this module's
    names): the self-test child gives the probes it already made, one step each, and its fault hooks. `prove`
    opens and checks a candidate on a full run, `evaluate` re-checks a cached winner, `before_run` runs inside
    the latency loop's timed region before each run."""

    detect_providers: Callable[..., list[ProviderStatus]] = detect_providers
    prove: Callable[..., Trial] = prove
    evaluate: Callable[..., CandidateResult] = evaluate
    before_run: Callable[[Candidate, int], None] | None = None


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


def run_selftest(bundle: Bundle, state_dir: Path | None, opts: SelftestOptions = SelftestOptions(),
                 seams: Seams = Seams()) -> SelftestReport:
    """Probe, build candidates, evaluate in priority order, choose. Never raises for a bad candidate.

    The steps, in order: read the golden samples and check the device's preprocessing; probe the providers;
    re-check a cached winner (done when it still passes); prove each provider group's candidates and time
    those that passed; re-measure latency when only latency failed; finish (the reduced-decode check, the
    report, the cache)."""
    run = _start(bundle, state_dir, opts, seams)
    cached = _cached_winner(run)
    if cached is not None:
        return cached
    results, trials, selected = _prove_groups(run)
    attempts: list[dict[str, Any]] = []
    degraded: str | None = None
    if selected is None and should_remeasure_latency(results):
        results, selected, attempts = _remeasure(run, results, trials)
        if selected is None and opts.policy.when_too_slow == "degraded":
            selected, degraded = _serve_degraded(run, results, len(attempts))
    won = trials.get(selected.candidate.key) if selected is not None else None
    return _finish(run, results, selected, cached=False, attempts=attempts, degraded=degraded,
                   opened=won.opened if won is not None else None)


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
                             lambda mk: time_interleaved(proven, _timing_tensor(run.golden), warmup, runs, manifest=m,
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
                         lambda mk: time_interleaved(slow, _timing_tensor(run.golden), warmup, runs, attempt,
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
