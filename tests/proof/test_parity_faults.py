"""Faults of the fidelity and reproduction judges (found reviewing issues 10 and 11): each test failed
on the code before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from agent.errors import BundleError
from agent.proof.parity import fidelity_floors, judge_fidelity
from agent.vocabulary.manifest import PostprocessSpec
from agent.testing import rewrite_manifest
from tests.proof.test_stateful import stateful_bundle  # noqa: F401  (fixture)

SIZE = 16


def test_a_variant_picking_a_far_class_on_a_near_tied_reference_is_a_counted_flip() -> None:
    # The reference cannot tell class 0 from class 1; the variant answers class 2, which the reference
    # scored far below both: that is no tie, it is a wrong answer.
    spec = PostprocessSpec(type="classification", output="p")
    ref = [{"p": np.r_[5.0, 4.99, np.zeros(8)].astype(np.float32)} for _ in range(32)]
    got = [{"p": np.r_[0.0, 0.0, 9.0, np.zeros(7)].astype(np.float32)} for _ in range(32)]
    r = judge_fidelity(spec, got, ref, fidelity_floors("classification"))
    assert not r.passed
    assert r.agreement is not None and r.agreement.metrics["top1_flips"] == 32
    assert "top-1 agreement" in r.findings[0].text()


def test_when_every_reference_margin_is_negligible_flips_are_counted_not_all_ignored() -> None:
    # Probabilities declared with apply_softmax (the default): after a second softmax every margin of a
    # 1000-class output is under 0.002, so ignoring near-ties ignored every sample and a variant that
    # answers another class on every frame kept "agreement 1.0 of 0 counted".
    spec = PostprocessSpec(type="classification", output="p")
    classes = 1000
    ref = [{"p": (np.eye(classes)[i] * 0.9 + 0.1 / classes).astype(np.float32)} for i in range(32)]
    got = [{"p": np.eye(classes)[(i + 300) % classes].astype(np.float32)} for i in range(32)]
    r = judge_fidelity(spec, got, ref, fidelity_floors("classification"))
    assert not r.passed
    assert r.agreement is not None and r.agreement.metrics["top1_counted"] == 32


def test_fidelity_still_ignores_a_flip_between_the_references_own_tied_classes() -> None:
    spec = PostprocessSpec(type="classification", output="p")
    ref = [{"p": np.r_[5.0, 4.99, np.zeros(8)].astype(np.float32)}] + \
          [{"p": np.r_[9.0, 0.0, np.zeros(8)].astype(np.float32)} for _ in range(31)]
    got = [{"p": np.r_[4.99, 5.0, np.zeros(8)].astype(np.float32)}] + ref[1:]
    r = judge_fidelity(spec, got, ref, fidelity_floors("classification"))
    assert r.passed
    assert r.agreement is not None and r.agreement.metrics["top1_ignored_negligible_margin"] == 1


# ------------------------------------------------------------------ raw outputs, channels last

def _drowned_scores(n: int = 8) -> tuple[list[dict], list[dict]]:
    """[anchors, 4 + 2] channels last: coordinates 0..330, scores 0..1 crushed to 0 / 1.26 in `got`."""
    rng = np.random.default_rng(0)
    ref, got = [], []
    for _ in range(n):
        r = np.concatenate([rng.uniform(0, 330, (100, 4)), rng.uniform(0, 1, (100, 2))], 1).astype(np.float32)
        g = r.copy()
        g[:, 4:] = np.where(r[:, 4:] > 0.6, 1.26, 0.0)
        ref.append({"o": r})
        got.append({"o": g})
    return got, ref


def test_channel_axis_minus_one_judges_each_channel_instead_of_the_whole_tensor() -> None:
    got, ref = _drowned_scores()
    spec = PostprocessSpec(type="raw", outputs=("o",), channel_axis=-1)
    r = judge_fidelity(spec, got, ref, fidelity_floors("raw"))
    assert not r.passed
    assert "channel 4" in r.findings[0].detail or "channel 5" in r.findings[0].detail


def test_channel_axis_zero_the_batch_axis_is_refused_by_the_manifest(tiny_bundle: Path) -> None:
    from agent.bundle.load import load_bundle

    def raw_on_batch_axis(m: dict) -> None:
        m["task"] = "raw"
        m["postprocess"] = {"type": "raw", "channel_axis": 0}

    rewrite_manifest(tiny_bundle, raw_on_batch_axis)
    with pytest.raises(BundleError, match="channel_axis"):
        load_bundle(tiny_bundle)


# ------------------------------------------------------------------ stateful models: reasons name real samples

def test_a_stateful_rejection_names_the_golden_sequence_and_its_step_not_a_flattened_row(
        stateful_bundle: Path, tmp_path: Path) -> None:  # noqa: F811
    # 6 golden sequences of 12 steps: the reason said "on sample 22", a sample that does not exist
    from agent.bundle.load import load_bundle
    from agent.proof.selftest import SelftestOptions, run_selftest

    b = tmp_path / "b"
    shutil.copytree(stateful_bundle, b)
    rewrite_manifest(b, lambda m: m["inputs"][0].__setitem__("value", 8000))  # the constant sr, tampered
    report = run_selftest(load_bundle(b), None, SelftestOptions(latency_runs=5, use_cache=False))
    assert report.selected is None
    n = len(load_bundle(b).manifest.golden)
    for r in report.results:
        for f in r.findings:
            assert f.sample is not None and 0 <= f.sample < n, f.text()
            assert "step " in f.detail and "of its sequence" in f.detail


# ------------------------------------------------------------------ one-output (binary) classifiers

def test_a_one_logit_classifier_is_binary_so_an_inverted_variant_fails_fidelity() -> None:
    # softmax of one value is always 1.0: every frame was "class 0, score 1.0" and any variant agreed
    from agent.vocabulary.decoders import decode

    spec = PostprocessSpec(type="classification", output="p")
    x = np.random.default_rng(0).normal(0, 3, 32).astype(np.float32)
    ref = [{"p": np.array([v], np.float32)} for v in x]
    got = [{"p": -r["p"]} for r in ref]
    r = judge_fidelity(spec, got, ref, fidelity_floors("classification"))
    assert not r.passed
    assert decode(spec, {"p": np.array([4.0], np.float32)})["top"][0]["class_id"] == 1
    assert decode(spec, {"p": np.array([-4.0], np.float32)})["top"][0]["class_id"] == 0
    assert decode(spec, {"p": np.array([-4.0], np.float32)})["top"][0]["score"] == pytest.approx(0.982, abs=1e-3)


def test_outputs_whose_length_follows_each_frame_are_bounded_sample_by_sample() -> None:
    # A text-line recogniser's output [1, T, C] has T from each line's width: stacking the golden samples'
    # outputs failed, so reproduction compared 0 elements and the channel SNR reported its 120 dB cap; a
    # corrupted FP32 of PP-OCRv4's recogniser was caught only by its post stage, an INT8 showed 120 dB.
    from agent.proof.parity import channel_snr, judge_reproduction, reproduction_bounds

    spec = PostprocessSpec(type="raw", output="p")
    rng = np.random.default_rng(5)
    ref = [{"p": rng.uniform(0, 1, (1, t, 12)).astype(np.float32)} for t in (20, 35, 27)]
    got = [{"p": r["p"].copy()} for r in ref]
    got[2]["p"][0, 3] += 0.3  # one step of the third line's scores drifts
    rep = judge_reproduction(spec, got, ref, reproduction_bounds("fp32", "CPUExecutionProvider"))
    assert rep.tolerance is not None and rep.tolerance.elements == sum(r["p"].size for r in ref)
    assert not rep.passed and rep.tolerance.sample == 2, rep.findings
    snr = channel_snr(spec, got, ref)
    assert snr.metrics["min_channel_snr_db"] < 60 and snr.worst_sample == 2
    assert judge_reproduction(spec, ref, ref, reproduction_bounds("fp32", "CPUExecutionProvider")).passed
