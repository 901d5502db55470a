"""The boot-time self-test: probe providers, try candidates, judge each on this device, pick one.

The shell around `verdict` and `selection`: it opens real sessions, runs the golden samples and the
latency loop, writes a crash marker before each candidate, caches verdicts, and writes the report.
This module holds the entry (`run_selftest`), a candidate's proof (`prove`, `evaluate`) and the seams a caller
may put something in front of; the steps `run_selftest` calls: selftest_steps.py; its report: selftest_report.py;
what is read from the golden samples first: golden_inputs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from agent.bundle.load import Bundle, GoldenSample
from agent.proof.golden_inputs import check_preprocessing, recorded_outputs, timing_tensor
from agent.proof.latency_loop import Trial, time_interleaved
from agent.proof.parity import fidelity_floors, judge_fidelity, judge_reproduction, reproduction_bounds
from agent.proof.probe import detect_providers
from agent.proof.reduced_decode import (  # noqa: F401 (names callers import from here)
    DECODE_PATHS,
    REDUCED_SCALES,
    SourceScaleLimit,
    check_reduced_decode,
    choosable_scale,
    decode_paths,
)
from agent.proof.replay import golden_steps, is_sequence, run_golden
from agent.proof.selection import should_remeasure_latency
from agent.proof.selftest_options import (  # noqa: F401 (names callers import from here)
    SelftestOptions,
    no_reduced_decode,
    options_from_config,
    serving_workers,
    source_scale_limits,
    video_frame_size,
    video_header,
)
from agent.proof.selftest_report import SelftestReport
from agent.proof.selftest_steps import _cached_winner, _finish, _prove_groups, _remeasure, _serve_degraded, _start
from agent.proof.serving_shapes import (  # noqa: F401 (tests import batch_sizes here)
    batch_sizes,
    judge_batches,
    judge_concurrent,
    run_concurrently,
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
from agent.proof.verdict import Candidate, CandidateResult, Evidence, PreprocessCheck, judge
from agent.vocabulary.batch_axis import check_single_sample_outputs
from agent.vocabulary.decoders import split_batch


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
        judged = _reproduction(opened, m, c, fed, golden, own_batched, plain, concurrent, workers, bounds)
        rep, fid = _fidelity(bundle, opened, c, golden, tensors, pre_check, judged, bounds)
        rep, fid = _locate(rep, judged.origin), _locate(fid, judged.origin)
        if concurrent:  # judged above, with the reproduction itself
            more = judged.concurrent_findings
        else:
            more = _serving_shapes(opened, m, fed, judged.got, sizes, bounds, plain, workers)
        if more:
            rep = replace(rep, findings=rep.findings + tuple(more))
    except Exception as exc:
        return Trial(c, Evidence(c, error=f"inference error: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}",
                                  effective=opened.effective, placement=opened.placement))
    ev = Evidence(c, None, opened.effective, opened.placement, pre_check, rep, fid, None, None, opened.create_ms,
                  tuple(opened.ort_log))
    return Trial(c, ev, opened)


@dataclass(frozen=True)
class _Judged:
    """The golden pass judged for reproduction: what the candidate gave (`got`, and narrowed to the outputs the
    bundle uses), the references it is judged against, each row's golden sample and step, and the findings of
    concurrent callers where the pass ran from them."""

    rep: Any
    got: list[dict[str, np.ndarray]]
    got_used: list[dict[str, np.ndarray]]
    refs_used: list[dict[str, np.ndarray]]
    origin: list[tuple[int, int | None]]
    concurrent_findings: list[Any]


def _reproduction(opened: Any, m: Any, c: Candidate, fed: Sequence[np.ndarray], golden: Sequence[GoldenSample],
                  own_batched: list[dict[str, np.ndarray]] | None, plain: bool, concurrent: bool, workers: int,
                  bounds: Any) -> _Judged:
    """The golden pass (from concurrent callers where `concurrent`) against the variant's recorded outputs, or
    without them against the source's references."""
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
    return _Judged(rep, got, got_used, refs_used, origin, concurrent_findings)


def _fidelity(bundle: Bundle, opened: Any, c: Candidate, golden: Sequence[GoldenSample], tensors: list[np.ndarray],
              pre_check: PreprocessCheck, judged: _Judged, bounds: Any) -> tuple[Any, Any]:
    """The fidelity answer, and the reproduction with the stages' own findings added: the post stage's
    reproduction and the size probes' (a sequence model is judged on its outputs alone)."""
    m = bundle.manifest
    rep = judged.rep
    floors = fidelity_floors(m.task, m.selftest.fidelity)
    # The model is proven on the bundled tensors; where this device's image library rounds differently, the
    # task is judged on what it will serve: its own tensors through the same candidate.
    fid_got = (used_outputs(m, golden_pass_of(opened, m, tensors, golden)[0])[0] if pre_check.rounding
               else judged.got_used)
    if any(is_sequence(g) for g in golden):
        fid = judge_fidelity(m.postprocess, fid_got, judged.refs_used, floors)
    else:  # the final served result: pre stage -> this candidate -> post stage -> result kind
        post = postprocessor_for(bundle)
        pre = preprocessor_for(bundle)  # one pre stage session for the geometries and the size probes
        geoms = golden_geometries(pre, golden)
        if isinstance(post, GraphPostprocessor):
            more_rep = judge_post_reproduction(m, post, judged.got, geoms, recorded_post(golden, c.variant), bounds)
            rep = replace(rep, findings=rep.findings + tuple(more_rep))
        fid = judge_final_fidelity(m, post, fid_got, judged.refs_used, geoms, load_answers(bundle, len(golden)),
                                   floors)
        rep = replace(rep, findings=rep.findings + tuple(judge_size_probes(
            opened, m, c.variant, golden, bounds, pre, tensor_bound=not pre_check.rounding)))
    if pre_check.rounding:
        fid = replace(fid, findings=tuple(replace(f, detail="on this device's own preprocessing, which rounds "
                                                  "differently from the bundle's" + (f"; {f.detail}" if f.detail else ""))
                                          for f in fid.findings))
    return rep, fid


def _serving_shapes(opened: Any, m: Any, fed: Sequence[np.ndarray], got: list[dict[str, np.ndarray]],
                    sizes: Sequence[int], bounds: Any, plain: bool, workers: int) -> list[Any]:
    """Serving's other shapes, where the golden pass ran from one caller: each micro-batch size, else the set from
    as many concurrent callers as serving has."""
    more = judge_batches(opened, m, fed, got, sizes, bounds) if sizes else []
    if not more and plain and workers > 1:
        more = judge_concurrent(opened, m, fed, got, workers, bounds)
    return list(more)


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


def evaluate(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
             latency: bool = True, latency_runs: int | None = None,
             preprocessed: tuple[PreprocessCheck, list[np.ndarray]] | None = None,
             max_batch: int = 1, workers: int = 1,
             before_run: Callable[[Candidate, int], None] | None = None) -> CandidateResult:
    """One candidate alone: the two questions, then (optionally) its latency. Never raises."""
    m = bundle.manifest
    trial = prove(bundle, c, settings, golden, preprocessed, max_batch=max_batch, workers=workers)
    if latency:
        time_interleaved([trial], timing_tensor(golden), m.selftest.warmup_runs,
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
