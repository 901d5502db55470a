"""Reproduction on a raw detection head judges its channel groups each against its own range: box
coordinates (0..320) no longer set the tolerance of the class scores (0..1)."""

from __future__ import annotations

import numpy as np

from agent.proof.parity import judge_reproduction, reproduction_bounds
from agent.vocabulary.manifest import PostprocessSpec

YOLOV8 = PostprocessSpec(type="detection", output="out", layout="yolov8", box_format="cxcywh", score_threshold=0.25)


def _head(rng: np.random.Generator, anchors: int = 64, classes: int = 3) -> np.ndarray:
    """One [4+C, N] YOLOv8 head: boxes in pixels, two confident anchors, every other score near 0."""
    boxes = np.stack([rng.uniform(40, 280, anchors), rng.uniform(40, 280, anchors),
                      rng.uniform(10, 60, anchors), rng.uniform(10, 60, anchors)])
    scores = rng.uniform(0.0, 0.02, (classes, anchors))
    scores[0, 3], scores[1, 40] = 0.92, 0.81
    return np.concatenate([boxes, scores]).astype(np.float32)


def test_a_perturbed_score_channel_is_rejected_although_the_boxes_are_exact() -> None:
    rng = np.random.default_rng(0)
    recorded = [{"out": _head(rng)} for _ in range(4)]
    got = []
    for r in recorded:
        g = r["out"].copy()
        g[4 + 2] += 0.2  # class 2 everywhere +0.2: under the 0.25 threshold, so every decoded box is the same
        got.append({"out": g})
    q = judge_reproduction(YOLOV8, got, recorded, reproduction_bounds("int8", "CPUExecutionProvider"))
    assert not q.passed, q.to_dict()
    assert q.agreement is not None and q.agreement.metrics["recall"] == 1.0  # the decode alone cannot see it
    assert q.tolerance is not None and q.tolerance.output == "out channels 4:7"
    assert q.tolerance.bound < 0.1  # the score range's tolerance, not the boxes' (about 9)


def test_an_exact_head_and_int8_sized_box_noise_still_reproduce() -> None:
    rng = np.random.default_rng(1)
    recorded = [{"out": _head(rng)} for _ in range(4)]
    got = []
    for r in recorded:
        g = r["out"].copy()
        g[:4] += rng.uniform(-1.0, 1.0, g[:4].shape)  # a pixel of box noise: inside 3 % of the box range
        g[4:] += rng.uniform(-0.005, 0.005, g[4:].shape)
        got.append({"out": g})
    q = judge_reproduction(YOLOV8, got, recorded, reproduction_bounds("int8", "CPUExecutionProvider"))
    assert q.passed, q.to_dict()
