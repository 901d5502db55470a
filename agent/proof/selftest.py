"""The boot-time self-test: probe providers, try candidates, judge each on this device, pick one.

The shell around `verdict` and `selection`: it opens real sessions, runs the golden samples and the
latency loop, writes a crash marker before each candidate, caches verdicts, and writes the report.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from agent import __version__
from agent.bundle.load import Bundle, GoldenSample
from agent.fsio import read_json, write_json_atomic
from agent.hashing import sha256_bytes
from agent.logsetup import get_logger
from agent.proof.parity import compare
from agent.proof.probe import detect_providers, device_fingerprint
from agent.proof.selection import (
    SelectionPolicy,
    build_candidates,
    choose,
    provider_groups,
)
from agent.proof.session import measure_latency, open_session
from agent.proof.terms import DEFAULT_ORDER, ProviderStatus, SessionSettings
from agent.proof.verdict import (
    Candidate,
    CandidateResult,
    Evidence,
    PreprocessCheck,
    judge,
)
from agent.spec.decoders import split_batch

log = get_logger("selftest")

REPORT_SCHEMA = 1


@dataclass(frozen=True)
class SelftestOptions:
    policy: SelectionPolicy = SelectionPolicy()
    settings: SessionSettings = SessionSettings()
    provider_order: tuple[str, ...] = DEFAULT_ORDER
    provider_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    use_cache: bool = True
    latency_runs: int | None = None  # None: the bundle's own setting


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
        return {
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
            "cached": self.cached,
            "cache_key": self.cache_key,
            "duration_ms": round(self.duration_ms, 1),
        }


def check_preprocessing(bundle: Bundle, golden: Sequence[GoldenSample]) -> tuple[PreprocessCheck, list[np.ndarray]]:
    """Run the device's preprocessing on each golden raw frame and compare with the bundled tensor."""
    pre = bundle.preprocessor()
    worst, worst_i, tensors = 0.0, 0, []
    for g in golden:
        t = pre(g.raw)
        tensors.append(t)
        d = float(np.max(np.abs(t.astype(np.float64) - g.input.astype(np.float64)))) if t.shape == g.input.shape else float("inf")
        if d > worst:
            worst, worst_i = d, g.index
    return PreprocessCheck(worst, worst_i), tensors


def evaluate(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
             latency: bool = True, latency_runs: int | None = None,
             preprocessed: tuple[PreprocessCheck, list[np.ndarray]] | None = None) -> CandidateResult:
    """Open the candidate's session and gather all evidence; any failure becomes a verdict, never a raise.

    `preprocessed` (from check_preprocessing) is the same for every candidate: pass it to do it once."""
    m = bundle.manifest
    model = bundle.path(m.variant(c.variant).file)
    try:
        opened = open_session(model, c.provider, c.options, settings, sample=golden[0].input)
    except Exception as exc:  # provider/ORT errors of every kind are a failed candidate
        return judge(Evidence(c, error=f"session creation error: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"), m)
    pre_check, tensors = preprocessed or check_preprocessing(bundle, golden)
    try:
        # End to end (device preprocessing) when preprocessing holds; the bundled tensors otherwise,
        # so a model fault is still told apart from a preprocessing fault.
        use_device = pre_check.max_abs <= m.selftest.preprocess_max_abs
        outputs = [opened.run(t if use_device else g.input) for t, g in zip(tensors, golden)]
        parity = compare(m.postprocess, [split_batch(o, 0) for o in outputs],
                         [split_batch(g.outputs, 0) for g in golden])
        stats = None
        if latency:
            runs = latency_runs or m.selftest.latency_runs
            stats = measure_latency(opened.run, golden[0].input, m.selftest.warmup_runs, runs)
    except Exception as exc:
        return judge(Evidence(c, error=f"inference error: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}",
                              effective=opened.effective, placement=opened.placement), m)
    ev = Evidence(c, None, opened.effective, opened.placement, pre_check, parity, stats, opened.create_ms,
                  tuple(opened.ort_log))
    return judge(ev, m)


class CrashMarkers:
    """A marker written before each candidate; one found at start means that candidate killed us."""

    def __init__(self, directory: Path):
        self.inflight = directory / "inflight.json"
        self.crashed_file = directory / "crashed.json"

    def recover(self) -> dict[str, str]:
        crashed: dict[str, str] = read_json(self.crashed_file, {}) or {}
        left = read_json(self.inflight)
        if left:
            key = f"{left['bundle']}|{left['candidate']}"
            crashed[key] = left.get("started", "")
            write_json_atomic(self.crashed_file, crashed)
            log.warning("selftest.crash_marker_found", candidate=left["candidate"], bundle=left["bundle"][:12])
        if self.inflight.exists():
            self.inflight.unlink()
        return crashed

    def enter(self, bundle_sha: str, c: Candidate) -> None:
        write_json_atomic(self.inflight, {"bundle": bundle_sha, "candidate": c.key,
                                          "started": datetime.now(timezone.utc).isoformat()})

    def leave(self) -> None:
        self.inflight.unlink(missing_ok=True)


def cache_key(bundle: Bundle, statuses: Sequence[ProviderStatus], opts: SelftestOptions,
              fingerprint: Mapping[str, str]) -> str:
    material = {
        "bundle": bundle.manifest_sha256,
        "onnxruntime": ort.__version__,
        "providers": [(s.name, s.usable, sorted(s.versions.items()), sorted(s.options.items())) for s in statuses],
        "device": sorted(fingerprint.items()),
        "policy": repr(opts.policy),
        "settings": repr(opts.settings),
    }
    return sha256_bytes(json.dumps(material, sort_keys=True, default=str).encode())


def run_selftest(bundle: Bundle, state_dir: Path | None, opts: SelftestOptions = SelftestOptions()) -> SelftestReport:
    """Probe, build candidates, evaluate in priority order, choose. Never raises for a bad candidate."""
    t0 = time.perf_counter()
    created = datetime.now(timezone.utc).isoformat()
    m = bundle.manifest
    golden = bundle.golden()
    preprocessed = check_preprocessing(bundle, golden)  # the device's preprocessing: one check for all candidates
    statuses = detect_providers(opts.provider_order, opts.provider_options, opts.settings)
    for s in statuses:
        log.info("provider.probed", provider=s.name, listed=s.listed, usable=s.usable, reason=s.reason)
    fingerprint = device_fingerprint()
    key = cache_key(bundle, statuses, opts, fingerprint)
    candidates, notes = build_candidates(m, statuses, opts.policy, opts.provider_options)
    directory = (state_dir / "selftest") if state_dir else None
    markers = CrashMarkers(directory) if directory else None
    crashed = markers.recover() if markers else {}

    def finish(results: list[CandidateResult], selected: CandidateResult | None, cached: bool) -> SelftestReport:
        report = SelftestReport(bundle, tuple(statuses), tuple(results), selected, tuple(notes), key, cached,
                                (time.perf_counter() - t0) * 1000, created, fingerprint)
        if directory:
            write_json_atomic(directory / "report.json", report.to_dict())
            if selected is not None and not cached:
                write_json_atomic(directory / "cache.json", {"key": key, "candidate": selected.candidate.key,
                                                             "report": report.to_dict()})
        log.info("selftest.done", bundle=bundle.identity, passed=selected is not None, cached=cached,
                 selected=selected.candidate.key if selected else None, reason=report.reason,
                 duration_ms=round(report.duration_ms, 1))
        return report

    if opts.use_cache and directory:
        cached = read_json(directory / "cache.json")
        if cached and cached.get("key") == key:
            hit = next((c for c in candidates if c.key == cached.get("candidate")), None)
            if hit is not None:
                quick = _guarded(markers, bundle, hit, lambda: evaluate(bundle, hit, opts.settings, golden, latency=False,
                                                        preprocessed=preprocessed))
                if quick.passed:
                    log.info("selftest.cache_hit", candidate=hit.key)
                    return finish([quick], quick, cached=True)
                log.warning("selftest.cache_recheck_failed", candidate=hit.key, reasons=list(quick.reasons))

    results: list[CandidateResult] = []
    selected: CandidateResult | None = None
    for group in provider_groups(candidates):
        if selected is not None:
            results += [CandidateResult(c, False, ("not tried: a higher-priority provider passed",), None, "not_tried")
                        for c in group]
            continue
        group_results = []
        for c in group:
            if f"{bundle.manifest_sha256}|{c.key}" in crashed:
                r = CandidateResult(c, False, ("skipped: this candidate crashed the agent during an earlier self-test",),
                                    None, "skipped")
            else:
                log.info("selftest.candidate_start", candidate=c.key)
                r = _guarded(markers, bundle, c,
                             lambda c=c: evaluate(bundle, c, opts.settings, golden, latency_runs=opts.latency_runs,
                                                  preprocessed=preprocessed))
            level = log.info if r.passed else log.warning
            level("selftest.candidate_passed" if r.passed else "selftest.candidate_rejected",
                  candidate=c.key, reasons=list(r.reasons),
                  p50_ms=r.evidence.latency.p50_ms if r.evidence and r.evidence.latency else None)
            group_results.append(r)
        results += group_results
        selected = choose(group_results, opts.policy.prefer_margin)
    return finish(results, selected, cached=False)


def _guarded(markers: CrashMarkers | None, bundle: Bundle, c: Candidate, fn: Any) -> CandidateResult:
    if markers:
        markers.enter(bundle.manifest_sha256, c)
    try:
        return fn()
    finally:
        if markers:
            markers.leave()


def options_from_config(cfg: Any, provider: str | None = None, variant: str | None = None,
                        use_cache: bool | None = None) -> SelftestOptions:
    sel = cfg.selection
    policy = SelectionPolicy(provider=provider or sel.provider, variant=variant or sel.variant,
                             allow_cpu_fallback=sel.allow_cpu_fallback, prefer_margin=sel.prefer_margin)
    order = tuple(cfg.providers.order)
    if policy.provider and policy.provider not in order:
        order = (policy.provider,) + order
    return SelftestOptions(policy=policy, settings=cfg.session, provider_order=order,
                           provider_options=cfg.providers.options,
                           use_cache=sel.use_cache if use_cache is None else use_cache)
