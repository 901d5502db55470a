"""Faults of the decoders (found reviewing issues 10 and 11): each test failed on the code before its fix."""

from __future__ import annotations


import numpy as np

from agent.vocabulary.decoders import layout_problems
from agent.vocabulary.manifest import PostprocessSpec

SIZE = 16


def test_yolov5_layout_declared_on_a_yolov8_shaped_output_is_refused() -> None:
    # [1, 84, 8400] is YOLOv8's (4 + classes, anchors); read as yolov5 it decodes 84 "anchors" of 8395 classes
    p = PostprocessSpec(type="detection", layout="yolov5", output="out")
    problems = layout_problems(p, {"out": [1, 84, 8400]})
    assert problems and "yolov8" in problems[0]
    assert layout_problems(p, {"out": [1, 25200, 85]}) == []


# ------------------------------------------------------------------ non-finite outputs in serving

def _strict(result: dict) -> dict:
    import json

    def refuse(name: str) -> None:
        raise ValueError(f"non-finite {name} in a result")

    return json.loads(json.dumps(result, allow_nan=True), parse_constant=refuse)


def test_non_finite_end2end_boxes_decode_to_a_strict_json_result_not_an_exception() -> None:
    # decode raised ValueError("Out of range float values..."), which the publisher does not catch
    from agent.vocabulary.decoders import decode

    p = PostprocessSpec(type="detection", layout="end2end", output="o")
    o = np.array([[[1, 2, 3, 4, 0.9, 0], [np.nan, 2, 3, 4, 0.8, 1], [np.inf, 0, 5, 5, 0.7, 2],
                   [1, 1, 2, 2, np.nan, 0]]], np.float32)
    result = _strict(decode(p, {"o": o}))
    assert [d["class_id"] for d in result["detections"]] == [0]


def test_an_infinite_probability_map_decodes_to_a_strict_json_result_not_an_exception() -> None:
    from agent.vocabulary.decoders import decode

    p = PostprocessSpec(type="segmentation", output="m", mask="rle")
    m = np.zeros((1, 1, 32, 32), np.float32)
    m[0, 0, 2:10, 2:10] = 0.9
    m[0, 0, 20:30, 20:30] = np.inf
    result = _strict(decode(p, {"m": m}))
    assert len(result["regions"]) == 2
