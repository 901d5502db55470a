"""Result kind `boxes`: judged against the package's own boxes one to one, with localisation, score and
keypoint error per match, and the sample that broke a floor named (never a pooled figure passed off as it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import boxes, kind_for, kind_reading


def _box(x1: float, y1: float, x2: float, y2: float, score: float = 0.9, cls: int = 0,
         kps: list[list[float]] | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"box": [x1, y1, x2, y2], "score": score, "class_id": cls, "label": str(cls)}
    if kps is not None:
        d["keypoints"] = kps
    return d


def _res(*bs: dict[str, Any]) -> dict[str, Any]:
    return {"type": "boxes", "boxes": list(bs)}


def _package(n: int = 6) -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        xy = rng.uniform(50, 400, (4, 2))
        out.append(_res(*(_box(x, y, x + 60, y + 40, 0.8, int(k % 2)) for k, (x, y) in enumerate(xy))))
    return out


def test_boxes_near_origin_fail_recall_and_name_the_sample() -> None:
    package = _package()
    served = list(package)
    # the wrong decoder of issue 21: every box a few pixels from (0, 0), on sample 4
    served[4] = _res(*(_box(0, 0, 3, 2, 0.8, k % 2) for k in range(4)))
    figures, findings = boxes.fidelity(served, package)
    recall = next(f for f in findings if f.metric.startswith("recall"))
    assert recall.sample == 4 and recall.bound == 0.9 and recall.comparison == "under"
    assert recall.value == pytest.approx(20 / 24)
    assert "pooled" in recall.metric and "sample 4 alone: 0 of 4" in recall.detail
    assert figures["worst_sample"] == 4 and figures["recall"] == pytest.approx(20 / 24)
    assert any(f.metric.startswith("precision") and f.sample == 4 for f in findings)


def test_identical_boxes_pass_with_perfect_figures() -> None:
    package = _package()
    figures, findings = boxes.fidelity(package, package)
    assert findings == []
    assert figures["recall"] == figures["precision"] == 1.0
    assert figures["median_iou"] == figures["min_iou"] == 1.0 and figures["max_score_diff"] == 0.0


def test_shifted_box_matched_at_iou_06_fails_localisation_floor_not_recall() -> None:
    # 100 x 100 box shifted by 25 px: IoU = 75*100 / (2*10000 - 7500) = 0.6
    package = [_res(_box(100, 100, 200, 200))]
    served = [_res(_box(125, 100, 225, 200))]
    figures, findings = boxes.fidelity(served, package)
    assert figures["recall"] == 1.0 and figures["median_iou"] == pytest.approx(0.6)
    [loc] = findings
    assert loc.metric.startswith("median IoU") and loc.value == pytest.approx(0.6) and loc.bound == 0.85
    assert loc.sample == 0


def test_score_off_by_003_fails_tolerance_on_that_sample() -> None:
    package = _package(3)
    served = [dict(r) for r in package]
    served[2] = _res(*[{**b, "score": b["score"] - 0.03} if k == 1 else b for k, b in enumerate(package[2]["boxes"])])
    figures, findings = boxes.fidelity(served, package)
    [f] = findings
    assert f.metric.startswith("|score") and f.value == pytest.approx(0.03) and f.bound == 0.02
    assert f.sample == 2 and f.comparison == "over" and "1 of 12 matches" in f.detail
    assert figures["scores_over_tolerance"] == 1


def test_keypoints_5px_off_on_a_50px_box_fail_normalised_error() -> None:
    kps = [[110.0, 110.0], [140.0, 110.0], [125.0, 130.0]]
    package = [_res(_box(100, 100, 150, 150, kps=kps))]
    moved = [[x + 5.0, y] for x, y in kps]
    figures, findings = boxes.fidelity([_res(_box(100, 100, 150, 150, kps=moved))], package)
    [f] = findings
    assert f.metric == "keypoint error / box diagonal"
    assert f.value == pytest.approx(5 / np.hypot(50, 50)) and f.value > 0.05 and f.sample == 0
    # the same 5 px on a 500 px box is within the floor
    big = [_res(_box(0, 0, 500, 500, kps=kps))]
    assert boxes.fidelity([_res(_box(0, 0, 500, 500, kps=moved))], big)[1] == []


def test_served_boxes_without_the_packages_keypoints_fail() -> None:
    package = [_res(_box(0, 0, 50, 50, kps=[[10.0, 10.0]]))]
    _, findings = boxes.fidelity([_res(_box(0, 0, 50, 50))], package)
    assert [f.metric for f in findings] == ["keypoints per matched box"]


def test_matching_is_one_to_one_and_per_class() -> None:
    package = [_res(_box(0, 0, 100, 100, cls=0), _box(0, 0, 100, 100, cls=0))]
    # one served box cannot match two package boxes; a box of another class matches none
    figures, _ = boxes.fidelity([_res(_box(0, 0, 100, 100, cls=0), _box(0, 0, 100, 100, cls=1))], package)
    assert figures["matched"] == 1 and figures["recall"] == 0.5 and figures["precision"] == 0.5


def test_greedy_by_iou_matches_where_greedy_by_package_score_would_not() -> None:
    # package A (score 0.9) overlaps s0 at 0.82 and s1 at 0.6; package B (score 0.5) overlaps s0 at 0.96 and s1
    # under 0.5. Taking A first (by score) leaves B unmatched; by IoU, B-s0 then A-s1: both matched.
    package = [_res(_box(0, 0, 100, 100, 0.9), _box(12, 0, 112, 100, 0.5))]
    served = [_res(_box(10, 0, 110, 100, 0.9), _box(-25, 0, 75, 100, 0.5))]
    pa = np.array([b["box"] for b in package[0]["boxes"]], float)
    ps = np.array([b["box"] for b in served[0]["boxes"]], float)
    from agent.vocabulary.decoders import iou
    m = iou(pa, ps)
    assert m[0, 0] > m[0, 1] >= 0.5 and m[1, 0] > m[0, 0] and m[1, 1] < 0.5  # the premise
    figures, _ = boxes.fidelity(served, package, {"score_tolerance": 1.0, "min_median_iou": 0.0})
    assert figures["matched"] == 2 and figures["min_iou"] == pytest.approx(0.6)


def test_normalise_accepts_the_vocabularys_detection_result() -> None:
    from agent.vocabulary.decoders import decode
    from agent.vocabulary.manifest import PostprocessSpec

    spec = PostprocessSpec(type="detection", boxes_output="b", scores_output="s", score_threshold=0.5)
    outputs = {"b": np.array([[10, 20, 50, 60], [0, 0, 5, 5]], np.float32),
               "s": np.array([[0.1, 0.8], [0.2, 0.1]], np.float32)}
    vocab = decode(spec, outputs, labels=["cat", "dog"])
    assert vocab["type"] == "detection"
    value = boxes.normalise(vocab)
    assert [(b.box, b.class_id, b.label) for b in value.boxes] == [((10.0, 20.0, 50.0, 60.0), 1, "dog")]
    assert kind_reading("detection") is boxes
    # the vocabulary's result judged against the kind's compact form of the same boxes
    mine = [_res(_box(10, 20, 50, 60, 0.8, 1))]
    assert boxes.fidelity([vocab], mine)[1] == []


def test_compact_sorts_drops_padding_and_nonfinite_rows_and_maps_names() -> None:
    spec = {"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores", "class_ids": "det_cls",
            "keypoints": "det_kps", "score_threshold": 0.3}
    t = {"det_boxes": np.array([[[0, 0, 10, 10], [5, 5, 20, 20], [0, 0, 0, 0], [1, 1, 2, 2]]], np.float32),
         "det_scores": np.array([[0.4, 0.9, 0.0, np.nan]], np.float32),
         "det_cls": np.array([[1, 0, 0, 0]], np.int64),
         "det_kps": np.zeros((1, 4, 2, 3), np.float32)}
    assert boxes.check(t, spec) == ["result boxes field 'scores' (output 'det_scores'): 1 of 4 values are not finite"]
    r = boxes.compact(t, spec, labels=["person", "car"])
    assert [b["score"] for b in r["boxes"]] == [0.9, 0.4]
    assert r["boxes"][1] == {"box": [0.0, 0.0, 10.0, 10.0], "score": 0.4, "class_id": 1, "label": "car",
                             "keypoints": [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]}
    assert boxes.normalise(r).boxes[0].keypoints == ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


def test_compact_of_a_frame_with_no_box_and_a_keypoints_field_is_empty() -> None:
    """Fault: a face detector's frame without a face (keypoints [0, 5, 2]) crashed bundle create with an
    internal error (the finite check reshaped 0 rows to (0, -1))."""
    spec = {"kind": "boxes", "keypoints": "keypoints"}
    t = {"boxes": np.zeros((0, 4), np.float32), "scores": np.zeros(0, np.float32),
         "keypoints": np.zeros((0, 5, 2), np.float32)}
    assert boxes.check(t, spec) == []
    assert boxes.compact(t, spec) == {"type": "boxes", "boxes": []}


def test_check_names_missing_fields_disagreeing_lengths_and_inverted_boxes() -> None:
    assert boxes.check({"scores": np.zeros(3, np.float32)}, {})[0].startswith("result boxes field 'boxes' (output "
                                                                             "'boxes') is missing")
    p = boxes.check({"boxes": np.zeros((3, 4), np.float32), "scores": np.zeros(2, np.float32)}, {})
    assert p == ["result boxes: fields disagree on the number of items: boxes has 3, scores has 2"]
    # cxcywh served as xyxy: width smaller than the centre
    p = boxes.check({"boxes": np.array([[50, 50, 20, 20]], np.float32), "scores": np.ones(1, np.float32)}, {})
    assert "x2 < x1" in p[0]
    assert boxes.check({"boxes": np.zeros((3, 5), np.float32), "scores": np.zeros(3, np.float32)}, {})


def test_normalise_errors_name_the_field() -> None:
    with pytest.raises(BundleError, match=r"field boxes\[1\]\.box\[2\]: a finite number wanted"):
        boxes.normalise(_res(_box(0, 0, 1, 1), {"box": [0, 0, "x", 1], "score": 1}))
    with pytest.raises(BundleError, match=r"field boxes\[0\]\.score: missing"):
        boxes.normalise(_res({"box": [0, 0, 1, 1]}))
    with pytest.raises(BundleError, match="'segmentation' is not a result this kind reads"):
        boxes.normalise({"type": "segmentation", "regions": []})


def test_golden_set_without_any_box_warns() -> None:
    assert boxes.golden_warnings([_res(), _res()])
    assert boxes.golden_warnings(_package()) == []


def test_authored_floors_replace_defaults_and_unknown_keys_are_refused() -> None:
    package = [_res(_box(100, 100, 200, 200))]
    served = [_res(_box(125, 100, 225, 200))]
    assert boxes.fidelity(served, package, {"min_median_iou": 0.5})[1] == []
    with pytest.raises(BundleError, match="selftest.fidelity.min_mask_iou: not a floor of result kind boxes"):
        boxes.fidelity(served, package, {"min_mask_iou": 0.5})
    assert kind_for("boxes") is boxes
    with pytest.raises(BundleError, match="unknown result kind 'bbox'"):
        kind_for("bbox")
