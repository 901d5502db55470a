"""Probation is a pure judge over what the new bundle really served; the pipeline tallies each engine apart."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2

from agent.bundle.load import load_bundle
from agent.config import PipelineConfig, SourceConfig
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.serving.pipeline import Pipeline
from agent.serving.sources import open_source
from agent.testing import ListSink, rewrite_manifest, structured_frames
from agent.updates.probation import ProbationEvidence, judge_probation, p95
from waiting import wait_until


def _ev(**kw) -> ProbationEvidence:
    base = dict(seconds=2.0, frames=100, results=100, refused=0, inference_errors=0, non_finite=0,
                inference_p95_ms=1.0, budget_ms=50.0)
    return ProbationEvidence(**{**base, **kw})


def test_probation_passes_a_bundle_that_served_cleanly_within_budget() -> None:
    v = judge_probation(_ev())
    assert v.passed and v.reasons == () and "100 results from 100 frames" in v.summary
    assert v.to_dict()["evidence"]["results"] == 100


def test_probation_fails_a_bundle_that_served_zero_results() -> None:
    v = judge_probation(_ev(frames=0, results=0))
    assert not v.passed and v.reasons[0].startswith("zero results")


def test_probation_fails_a_frame_format_mismatch_that_refused_every_frame() -> None:
    """Fault: 111 frames in, 111 refused, 0 out, judged a pass and committed."""
    v = judge_probation(_ev(frames=111, results=0, refused=111))
    assert not v.passed and "frame-format mismatch" in v.reasons[0] and "111" in v.reasons[0]


def test_probation_fails_inference_errors_non_finite_outputs_and_p95_over_budget() -> None:
    assert "3 inference errors" in judge_probation(_ev(inference_errors=3)).reasons
    assert "2 inferences with non-finite outputs" in judge_probation(_ev(non_finite=2)).reasons
    v = judge_probation(_ev(inference_p95_ms=80.0))
    assert not v.passed and "over budget 50 ms" in v.reasons[0]
    assert judge_probation(_ev(inference_p95_ms=80.0, budget_ms=None)).passed  # no budget, no latency rule
    assert p95([]) is None and p95([1.0] * 19 + [100.0]) > 1.0


def test_pipeline_tallies_a_swapped_engine_apart_and_probation_sees_its_refusals(tiny_bundle_master: Path,
                                                                                  tmp_path: Path) -> None:
    """The new engine's frames are its own: a bundle whose frame format differs from the running source
    refuses every frame, serves nothing, and fails probation (the old engine's results do not count)."""
    gray = tmp_path / "gray"
    shutil.copytree(tiny_bundle_master, gray)
    rewrite_manifest(gray, lambda m: m["input"]["frame"].update(color="gray", channels=1))
    frames = tmp_path / "frames"
    frames.mkdir()
    for i, f in enumerate(structured_frames(6, 40, seed=5)):
        cv2.imwrite(str(frames / f"{i:02d}.png"), f)

    def engine(root: Path):
        b = load_bundle(root, check_contracts=False)
        return build_engine(b, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())

    old, new = engine(tiny_bundle_master), engine(gray)
    cfg = SourceConfig(type="folder", path=frames, loop=True, max_fps=100)
    source = open_source(cfg, old.bundle.manifest.frame)
    sink = ListSink()
    p = Pipeline(source, old, sink, PipelineConfig(), lossless=True, first_seq=41).start()
    try:
        assert wait_until(lambda: len(sink.results) >= 10, 20)
        p.swap_engine(new)
        tally = p.tally(new)
        assert wait_until(lambda: tally.frames >= 20, 20)  # the barrier: twenty frames judged under the new engine
    finally:
        p.stop()
        p.join(15)
        p.close_source()
    assert tally.results == 0 and tally.refused == tally.frames
    assert p.tally(old).results == len(sink.results) >= 10
    assert sink.results[0]["seq"] == 41  # a new pipeline continues the boot's seq
    v = judge_probation(ProbationEvidence(1.0, tally.frames, tally.results, tally.refused, tally.inference_errors,
                                          tally.non_finite, p95(tally.inference_ms), 50.0))
    assert not v.passed and "frame-format mismatch" in v.reasons[0]
    assert p.drops.get("refused_by_preprocessing") == tally.refused


def test_probation_under_the_degraded_policy_takes_the_slowness_its_proof_accepted() -> None:
    from dataclasses import replace

    e = ProbationEvidence(seconds=5.0, frames=50, results=50, refused=0, inference_errors=0, non_finite=0,
                          inference_p95_ms=9663.33, budget_ms=50.0, when_too_slow="degraded")
    v = judge_probation(e)
    assert v.passed and "DEGRADED: over budget 50 ms" in v.summary, v
    assert not judge_probation(replace(e, when_too_slow="none")).passed  # the default policy still refuses it
    assert not judge_probation(replace(e, inference_errors=1)).passed  # errors are never excused
