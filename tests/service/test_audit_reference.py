"""The live audit's reference session: a second session only where it can disagree with the served one."""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import numpy as np
from agentproc import DEMO_BUNDLE
from auditing import audited

from agent.bundle.load import load_bundle
from agent.service.serving_ledger import ServingWatch
from agent.testing import rewrite_manifest
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.service.audit import AuditSettings, Auditor
from agent.serving.engine import Engine, build_engine


def _audited(variant: str, precision: str) -> tuple[Auditor, object]:
    engine = build_engine(load_bundle(DEMO_BUNDLE), Candidate(CPU, variant, precision), SessionSettings())
    return audited(engine, 64, 3), engine


def test_a_served_fp32_on_the_cpu_is_its_own_reference_with_no_second_session() -> None:
    # the fault: serving CPU:fp32 opened a second FP32 session of the same model for the live audit
    # (25 MB more on a one-camera YOLO-320 agent, from its first live check on), which could only repeat it
    auditor, engine = _audited("fp32", "fp32")
    assert auditor._reference is engine and auditor.to_dict()["reference_shared"] is True
    assert auditor.counters["live_windows"] >= 1 and auditor.counters["live_drift"] == 0


def test_a_served_int8_is_audited_against_its_own_fp32_session() -> None:
    auditor, engine = _audited("int8", "int8")
    assert auditor._reference is not None and auditor._reference is not engine
    assert auditor._reference.candidate.variant == "fp32" and auditor.to_dict()["reference_shared"] is False
    assert auditor.counters["live_windows"] >= 1


def test_the_audit_keeps_each_golden_tensor_and_its_outputs_not_the_raw_frame() -> None:
    # the fault: the audit held every GoldenSample while the engine served, raw frames included
    # (14 MB of the YOLO-320 bundle's 24, never read by a canary); glibc kept the rest of the list's load
    bundle = load_bundle(DEMO_BUNDLE)
    golden = bundle.golden()
    tensors = sum(g.input.nbytes + sum(a.nbytes for a in g.variant_outputs["fp32"].values()) for g in golden)
    raw = sum(g.raw.nbytes for g in golden)
    del golden
    engine = build_engine(bundle, Candidate(CPU, "fp32", "fp32"), SessionSettings())
    auditor = Auditor(AuditSettings(), lambda: engine, SessionSettings())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        auditor._attach(engine)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(auditor._golden) == 16
    assert held < tensors + raw / 2, (held, tensors, raw)
    auditor._canary()  # the canary still runs, from what was kept
    assert auditor.counters["canary_runs"] == 1 and auditor.counters["canary_failures"] == 0


def _drifting_fp32(root: Path, tmp: Path) -> Engine:
    """A served CPU:fp32 whose answers changed after the proof (the drift fault: logits x-1 flip every top-1)."""
    bundle = load_bundle(root)
    key = "CPUExecutionProvider:fp32"
    watch = ServingWatch(tmp / "selftest", bundle.manifest_sha256, key, runs=1, faults={f"drift:{key}#0": "-1"})
    engine = build_engine(bundle, Candidate(CPU, "fp32", "fp32"), SessionSettings(), watch=watch)
    engine.run(bundle.golden()[0].input)  # past the marker's first runs
    return engine


def _audit_window(engine: Engine) -> Auditor:
    now = [0.0]
    auditor = Auditor(AuditSettings(canary_period_s=1.0, live_period_s=1.0, live_window=4), lambda: engine,
                      SessionSettings(), clock=lambda: now[0])
    auditor._attach(engine)
    for g in engine.bundle.golden()[:4]:
        now[0] += 10.0
        auditor._step()
        auditor._live(g.input, engine.run(g.input))
    return auditor


def test_a_served_fp32_that_drifted_is_caught_by_the_canary_against_the_recorded_outputs(tmp_path: Path) -> None:
    # sharing the session means the live check cannot see it (the reference is the drifted session):
    # the canary judges it against the bundle's recorded answers instead
    auditor = _audit_window(_drifting_fp32(DEMO_BUNDLE, tmp_path))
    assert auditor.reference_shared is True
    assert auditor.counters["canary_failures"] >= 1 and auditor.degraded is not None
    assert auditor.degraded["check"] == "canary"


def test_a_bundle_without_recorded_outputs_keeps_a_separate_reference_that_sees_a_drift(tmp_path: Path) -> None:
    # the fault a helper found: shared, and the canary judged against the engine as attached (already
    # drifted), a served fp32 that changed its answers passed both checks
    root = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, root)
    for f in sorted((root / "golden").glob("*.npz")):
        with np.load(f) as z:
            kept = {k: z[k] for k in z.files if not k.startswith("variant.")}
        np.savez(f, **kept)
    rewrite_manifest(root)
    engine = _drifting_fp32(root, tmp_path)
    auditor = _audit_window(engine)
    assert auditor.reference_shared is False and auditor._reference is not engine
    assert auditor.counters["live_drift"] == 1 and auditor.degraded is not None


def test_a_golden_file_unreadable_at_attach_leaves_no_partial_canary_list(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, root)
    bundle = load_bundle(root)
    engine = build_engine(bundle, Candidate(CPU, "fp32", "fp32"), SessionSettings())
    (root / bundle.manifest.golden[3]).write_bytes(b"not an npz")
    auditor = Auditor(AuditSettings(), lambda: engine, SessionSettings())
    try:
        auditor._attach(engine)
    except Exception:
        pass
    assert auditor._golden == []
