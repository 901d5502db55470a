"""post.priors in multiclass mode (agent/bundle/graphs/post_priors.py) in a real session against ssd.pytorch's
own decode, written in numpy from layers/functions/prior_box.py (PriorBox, voc 300 config: max sizes, aspect
ratios, clip), layers/box_utils.py (decode, nms) and layers/functions/detection.py (Detect: per class
threshold, top-k and NMS, then the best top_k over all classes)."""

from __future__ import annotations

from itertools import product
from math import sqrt
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.errors import UsageError  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402

VOC = {"feature_maps": [38, 19, 10, 5, 3, 1], "min_dim": 300, "steps": [8, 16, 32, 64, 100, 300],
       "min_sizes": [30, 60, 111, 162, 213, 264], "max_sizes": [60, 111, 162, 213, 264, 315],
       "aspect_ratios": [[2], [2, 3], [2, 3], [2, 3], [2], [2]], "variance": [0.1, 0.2], "clip": True}
PARAMS = {"width": 300, "height": 300, "steps": "8,16,32,64,100,300", "min_sizes": "30;60;111;162;213;264",
          "max_sizes": "60,111,162,213,264,315", "aspect_ratios": "2;2,3;2,3;2,3;2;2", "clip_priors": True,
          "multiclass": True, "landmarks": "", "pre_nms_top_k": 200, "max_detections": 200,
          "score_threshold": 0.01, "iou_threshold": 0.45, "legacy_plus_one": False}


def prior_box() -> np.ndarray:
    mean: list[float] = []
    image_size = VOC["min_dim"]
    for k, f in enumerate(VOC["feature_maps"]):
        for i, j in product(range(f), repeat=2):
            f_k = image_size / VOC["steps"][k]
            cx, cy = (j + 0.5) / f_k, (i + 0.5) / f_k
            s_k = VOC["min_sizes"][k] / image_size
            mean += [cx, cy, s_k, s_k]
            s_k_prime = sqrt(s_k * (VOC["max_sizes"][k] / image_size))
            mean += [cx, cy, s_k_prime, s_k_prime]
            for ar in VOC["aspect_ratios"][k]:
                mean += [cx, cy, s_k * sqrt(ar), s_k / sqrt(ar)]
                mean += [cx, cy, s_k / sqrt(ar), s_k * sqrt(ar)]
    output = np.array(mean, np.float32).reshape(-1, 4)
    return np.clip(output, 0, 1)


def decode(loc: np.ndarray, priors: np.ndarray, variances: list[float]) -> np.ndarray:
    boxes = np.concatenate((priors[:, :2] + loc[:, :2] * variances[0] * priors[:, 2:],
                            priors[:, 2:] * np.exp(loc[:, 2:] * variances[1])), 1)
    boxes[:, :2] -= boxes[:, 2:] / 2
    boxes[:, 2:] += boxes[:, :2]
    return boxes


def nms(boxes: np.ndarray, scores: np.ndarray, overlap: float, top_k: int) -> list[int]:
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    area = (x2 - x1) * (y2 - y1)
    idx = np.argsort(scores, kind="stable")[-top_k:]
    keep = []
    while idx.size > 0:
        i = idx[-1]
        keep.append(int(i))
        idx = idx[:-1]
        if idx.size == 0:
            break
        w = np.clip(np.minimum(x2[idx], x2[i]) - np.maximum(x1[idx], x1[i]), 0.0, None)
        h = np.clip(np.minimum(y2[idx], y2[i]) - np.maximum(y1[idx], y1[i]), 0.0, None)
        inter = w * h
        iou = inter / ((area[idx] - inter) + area[i])
        idx = idx[iou <= overlap]
    return keep


def detect(loc: np.ndarray, conf: np.ndarray, frame_hw: tuple[int, int], top_k: int = 200, conf_thresh: float = 0.01,
           nms_thresh: float = 0.45) -> np.ndarray:
    """Detect.forward for one image, boxes scaled to the frame (the demo's scale = [w, h, w, h]) and clipped:
    rows (x1, y1, x2, y2, score, class)."""
    boxes = decode(loc[0], prior_box(), VOC["variance"])
    rows = []
    for cl in range(1, conf.shape[2]):
        scores = conf[0][:, cl]
        mask = scores > conf_thresh
        if not mask.any():
            continue
        b, s = boxes[mask], scores[mask]
        for i in nms(b, s, nms_thresh, top_k):
            rows.append([*b[i], s[i], cl])
    out = np.array(rows, np.float64).reshape(-1, 6)
    out = out[np.argsort(-out[:, 4], kind="stable")][:top_k]  # the flt rank < top_k over all classes
    out[:, [0, 2]] = np.clip(out[:, [0, 2]] * frame_hw[1], 0, frame_hw[1])
    out[:, [1, 3]] = np.clip(out[:, [1, 3]] * frame_hw[0], 0, frame_hw[0])
    return out


def heads(classes: int, seed: int, objects: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    priors = prior_box()
    p = len(priors)
    loc = rng.normal(0, 0.5, (1, p, 4)).astype(np.float32)
    logits = rng.normal(0, 1, (p, classes))
    logits[:, 0] += 3.0  # background mostly
    for _ in range(objects):
        c = rng.uniform(0.2, 0.8, 2)
        size = rng.uniform(0.1, 0.5)
        near = np.where((np.abs(priors[:, :2] - c).max(1) < size / 2) & (np.abs(np.log(priors[:, 2] / size)) < 0.7))[0]
        loc[0, near, :2] = (c - priors[near, :2]) / (0.1 * priors[near, 2:]) + rng.normal(0, 0.3, (len(near), 2))
        loc[0, near, 2:] = np.log(size / priors[near, 2:]) / 0.2 + rng.normal(0, 0.3, (len(near), 2))
        logits[near, int(rng.integers(1, classes))] += rng.uniform(4, 8, len(near))
    e = np.exp(logits - logits.max(1, keepdims=True))
    return loc, (e / e.sum(1, keepdims=True))[None].astype(np.float32)


def run(params: dict[str, Any], loc: np.ndarray, conf: np.ndarray, frame_hw: tuple[int, int]) -> list[np.ndarray]:
    sess = ort.InferenceSession(build_graph("post.priors", params).SerializeToString(), providers=[CPU])
    geometry = np.array([300 / frame_hw[1], 300 / frame_hw[0], 0, 0, 0, 0], np.float32)  # SSD stretches to 300
    return sess.run(["boxes", "scores", "class_ids"], {"loc": loc, "conf": conf, "frame_size": np.array(frame_hw),
                                                       "geometry": geometry})


def test_priors_are_ssd_pytorchs_voc_300_priors() -> None:
    assert len(prior_box()) == 8732
    loc = np.zeros((1, 8732, 4), np.float32)
    conf = np.zeros((1, 8732, 2), np.float32)
    conf[0, :, 1] = np.linspace(0.999, 0.5, 8732)  # every prior kept (no overlap at 1.0), in prior order
    params = {**PARAMS, "pre_nms_top_k": 8732, "max_detections": 8732, "iou_threshold": 1.0}
    boxes, _, _ = run(params, loc, conf, (300, 300))
    pb = prior_box()
    want = np.concatenate([pb[:, :2] - pb[:, 2:] / 2, pb[:, :2] - pb[:, 2:] / 2 + pb[:, 2:]], 1) * 300
    np.testing.assert_allclose(boxes, np.clip(want, 0, 300), atol=2e-3)


@pytest.mark.parametrize("frame_hw", [(375, 500), (480, 270)])
@pytest.mark.parametrize("objects", [0, 6])
def test_multiclass_detect_matches_ssd_pytorch(frame_hw: tuple[int, int], objects: int) -> None:
    loc, conf = heads(21, seed=frame_hw[0] + objects, objects=objects)
    want = detect(loc, conf, frame_hw)
    boxes, scores, class_ids = run(PARAMS, loc, conf, frame_hw)
    assert len(want) == 200 and len(boxes) == 200  # the overall top_k bounds it
    order = np.argsort(-scores, kind="stable")
    np.testing.assert_allclose(scores[order], want[:, 4], rtol=1e-5)
    np.testing.assert_array_equal(class_ids[order], want[:, 5].astype(np.int64))
    np.testing.assert_allclose(boxes[order], want[:, :4], atol=5e-3, rtol=1e-4)


def test_per_class_top_k_and_thresholds_apply_before_the_overall_cut() -> None:
    loc, conf = heads(5, seed=3, objects=4)
    want = detect(loc, conf, (300, 300), top_k=30, conf_thresh=0.2, nms_thresh=0.3)
    boxes, scores, class_ids = run({**PARAMS, "pre_nms_top_k": 30, "max_detections": 30, "score_threshold": 0.2,
                                    "iou_threshold": 0.3}, loc, conf, (300, 300))
    assert 5 <= len(want) == len(boxes)
    order = np.argsort(-scores, kind="stable")
    np.testing.assert_allclose(scores[order], want[:, 4], rtol=1e-5)
    np.testing.assert_array_equal(class_ids[order], want[:, 5].astype(np.int64))


def test_ssd_prior_options_refuse_several_min_sizes_per_step() -> None:
    with pytest.raises(UsageError, match="max_sizes/aspect_ratios need one min size per step"):
        build_graph("post.priors", {"max_sizes": "1,2,3"})
    with pytest.raises(UsageError, match="--param aspect_ratios has 2 entries for 3 steps"):
        build_graph("post.priors", {"min_sizes": "16;64;256", "aspect_ratios": "2;2"})
