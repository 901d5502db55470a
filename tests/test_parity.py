"""Parity is task-aware: a detector that keeps cosine but loses its boxes fails; classification agreement counts."""

from __future__ import annotations

import numpy as np

from agent.spec.manifest import ParityThresholds, PostprocessSpec
from agent.proof.parity import compare, parity_failures
from agent.spec.decoders import decode, decode_detections

DET = PostprocessSpec(type="detection", boxes_output="boxes", scores_output="scores", score_threshold=0.5, iou_threshold=0.5)
CLS = PostprocessSpec(type="classification", output="logits", top_k=2)


def _detector_outputs(rng: np.random.Generator, anchors: int = 400, objects: int = 10) -> dict[str, np.ndarray]:
    boxes = np.zeros((anchors, 4), np.float32)
    xy = rng.uniform(0, 200, (anchors, 2))
    boxes[:, :2], boxes[:, 2:] = xy, xy + rng.uniform(10, 40, (anchors, 2))
    scores = rng.uniform(0, 0.3, (anchors, 3)).astype(np.float32)
    hot = rng.choice(anchors, objects, replace=False)
    scores[hot, rng.integers(0, 3, objects)] = 0.56
    return {"boxes": boxes, "scores": scores}


def test_detector_that_keeps_cosine_but_loses_boxes_fails_on_recall() -> None:
    rng = np.random.default_rng(0)
    refs = [_detector_outputs(rng) for _ in range(4)]
    # what a whole-graph INT8 detector does: scores shrink a little, most confident boxes drop under threshold
    got = [{"boxes": r["boxes"], "scores": r["scores"] * 0.88} for r in refs]
    report = compare(DET, got, refs)
    t = ParityThresholds(min_cosine=0.99, min_recall=0.9)
    assert report.worst_cosine.cosine > 0.99  # a cosine-only gate would pass this
    assert report.agreement["recall"] < 0.5
    failures = parity_failures(report, t)
    assert len(failures) == 1 and failures[0].startswith("parity recall = ")


def test_identical_detections_agree_fully() -> None:
    rng = np.random.default_rng(1)
    refs = [_detector_outputs(rng) for _ in range(3)]
    report = compare(DET, refs, refs)
    assert report.agreement["recall"] == 1.0 and report.agreement["precision"] == 1.0
    assert parity_failures(report, ParityThresholds(max_abs=0.0, min_recall=1.0, min_precision=1.0)) == []


def test_nms_removes_overlapping_boxes_of_the_same_class() -> None:
    out = {"boxes": np.array([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], np.float32),
           "scores": np.array([[0.9, 0.0], [0.8, 0.0], [0.0, 0.7]], np.float32)}
    dets = decode_detections(DET, out)
    assert [(d.class_id, round(d.score, 2)) for d in dets] == [(0, 0.9), (1, 0.7)]
    res = decode(DET, out, labels=["cat", "dog"])
    assert [d["label"] for d in res["detections"]] == ["cat", "dog"]


def test_classification_agreement_names_the_sample_and_stage() -> None:
    refs = [{"logits": np.array([3.0, 1.0, 0.0])}, {"logits": np.array([0.0, 2.0, 1.0])}]
    got = [{"logits": np.array([3.0, 1.0, 0.0])}, {"logits": np.array([0.0, 1.0, 2.0])}]
    report = compare(CLS, got, refs)
    assert report.agreement == {"top1_agreement": 0.5, "topk_agreement": 1.0}
    failures = parity_failures(report, ParityThresholds(max_abs=0.5, min_top1_agreement=0.9), stage="model")
    assert failures[0] == "parity max_abs = 1 over threshold 0.5 on sample 1 at stage model"
    assert failures[1] == "parity top1_agreement = 0.5000 under threshold 0.9 at stage model"


def test_non_finite_outputs_never_pass() -> None:
    refs = [{"logits": np.array([1.0, 2.0])}]
    got = [{"logits": np.array([np.nan, 2.0])}]
    report = compare(CLS, got, refs)
    assert parity_failures(report, ParityThresholds(min_cosine=0.0))
