"""The live audit's reference session: a second session only where it can disagree with the served one."""

from __future__ import annotations

import tracemalloc

import numpy as np
from agentproc import DEMO_BUNDLE

from agent.bundle.load import load_bundle
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.service.audit import AuditSettings, Auditor
from agent.serving.engine import build_engine


def _audited(variant: str, precision: str) -> tuple[Auditor, object]:
    engine = build_engine(load_bundle(DEMO_BUNDLE), Candidate(CPU, variant, precision), SessionSettings())
    now = [0.0]
    auditor = Auditor(AuditSettings(canary_period_s=1.0, live_period_s=1.0, live_window=2), lambda: engine,
                      SessionSettings(), clock=lambda: now[0])
    tensor = engine.preprocessor(np.zeros((64, 64, 3), np.uint8))
    for step in range(1, 4):
        now[0] = step * 10.0
        auditor._step()
        auditor._live(tensor, engine.run(tensor))
    return auditor, engine


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
