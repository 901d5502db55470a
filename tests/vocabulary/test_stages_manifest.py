"""Manifest keys of the stages (issue 21): each wrong combination refused naming its key; letterbox rounding."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

from agent.errors import BundleError
from agent.vocabulary.manifest import ResizeSpec, parse_manifest
from agent.vocabulary.preprocess import fit_geometry, letterbox_size, resize_image

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier" / "bundle.yaml"
BASE = yaml.safe_load(DEMO.read_text())


def _graph_manifest() -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    d["task"] = "classes"
    d["preprocess"] = {"graph": "pre.onnx"}
    d["postprocess"] = {"graph": "post.onnx", "labels": "labels.txt",
                        "result": {"kind": "classes", "probabilities": "probabilities"}}
    d["files"] = {**d["files"], "pre.onnx": "0" * 64, "post.onnx": "0" * 64}
    return d


def _parse(mutate: Callable[[dict[str, Any]], None]) -> Any:
    d = _graph_manifest()
    mutate(d)
    return parse_manifest(yaml.safe_dump(d), "bundle.yaml")


def test_graph_manifest_parses_with_the_stage_keys() -> None:
    m = _parse(lambda d: d["postprocess"].update(uses=["logits"]))
    assert m.stage_files == {"pre": "pre.onnx", "post": "post.onnx"}
    assert m.preprocess.dtype == m.input.dtype == "float32"
    assert m.postprocess.type == "graph" and m.postprocess.result.fields == {"probabilities": "probabilities"}
    assert m.used_outputs == ("logits",)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["preprocess"].update(scale=0.5), r"key preprocess.graph: .*\['scale'\] beside it"),
    (lambda d: d["postprocess"].pop("result"), r"key postprocess(.result)?"),
    (lambda d: d["postprocess"]["result"].update(boxes="b"), r"key postprocess.result.boxes: not a field of kind classes"),
    (lambda d: d.update(task="boxes"), r"key task: 'boxes' is not postprocess.result.kind 'classes'"),
    (lambda d: d["postprocess"].update(uses=["scores"]), r"key postprocess.uses\[0\]: 'scores' is not a declared output"),
    (lambda d: d["files"].pop("pre.onnx"), r"key preprocess.graph: 'pre.onnx' is not listed in files"),
    (lambda d: d["postprocess"]["result"].update(threshold=0.5), r"key postprocess.result.threshold: applies to masks"),
    (lambda d: d["input"]["frame"].update(width=0), r"key input.frame.max_size: frames of any size need"),
    (lambda d: d["input"]["frame"].update(max_size=[200, 200]), r"key input.frame.max_size: size bounds apply to frames"),
    (lambda d: d["input"]["frame"].update(width=0, min_size=[300, 10], max_size=[200, 200]),
     r"key input.frame.min_size: \[300, 10\] is over max_size"),
])
def test_stage_keys_that_do_not_fit_together_are_refused_naming_the_key(mutate: Callable, message: str) -> None:
    with pytest.raises(BundleError, match=message):
        _parse(mutate)


def test_vocabulary_bundle_may_state_its_result_kind_but_not_another() -> None:
    ok = copy.deepcopy(BASE)
    ok["postprocess"]["result"] = {"kind": "classes"}
    assert parse_manifest(yaml.safe_dump(ok)).postprocess.result.kind == "classes"
    ok["postprocess"]["result"] = {"kind": "boxes"}
    with pytest.raises(BundleError, match=r"key postprocess.result.kind: the vocabulary's classification serves kind "
                                          r"classes, not boxes"):
        parse_manifest(yaml.safe_dump(ok))


def test_resize_rounding_is_refused_outside_letterbox() -> None:
    d = copy.deepcopy(BASE)
    d["preprocess"]["resize"]["rounding"] = "floor"
    with pytest.raises(BundleError, match=r"key preprocess.resize.rounding: applies to letterbox"):
        parse_manifest(yaml.safe_dump(d))


def test_letterbox_rounding_floor_truncates_the_resized_side_as_int_truncating_packages_do() -> None:
    """A 100x37 frame into 64x64: scale 0.64, the short side 23.68 -> 24 rounded (OpenCV, Ultralytics),
    23 floored (YOLOX's int()); the padding and the pixels differ, which a rounding-only agent could not state."""
    rnd = ResizeSpec(width=64, height=64, mode="letterbox", anchor="top_left")
    flo = ResizeSpec(width=64, height=64, mode="letterbox", anchor="top_left", rounding="floor")
    assert letterbox_size(37, 100, rnd) == (64, 24)
    assert letterbox_size(37, 100, flo) == (64, 23)
    img = np.full((37, 100, 3), 200, np.uint8)
    a, b = resize_image(img, rnd), resize_image(img, flo)
    assert a.shape == b.shape == (64, 64, 3)
    assert a[23, 0, 0] == 200 and b[23, 0, 0] == 114  # row 23: image when rounded, padding when floored
    assert fit_geometry(37, 100, flo).scale_y == pytest.approx(0.64)


def test_post_graph_bundle_judges_a_raw_head_per_declared_channel_so_coordinates_never_bound_scores() -> None:
    """A decoded head [1, N, 6] (cx, cy, w, h in 0..640 pixels, objectness, class): with one range for the whole
    output, FP32's atol (1e-4 x 640) let a score move by 0.05; with `channel_axis: -1` each column has its own."""
    from agent.proof.parity import judge_reproduction, reproduction_bounds
    from agent.proof.terms import CPU

    rng = np.random.default_rng(0)
    head = np.concatenate([rng.uniform(0, 640, (1, 50, 4)), rng.uniform(0, 1, (1, 50, 2))], axis=2).astype(np.float32)
    moved = head.copy()
    moved[0, 7, 4] += 0.05  # one objectness score
    bounds = reproduction_bounds("fp32", CPU)
    whole = _parse(lambda d: None).postprocess
    per_channel = _parse(lambda d: d["postprocess"].update(channel_axis=-1)).postprocess
    assert per_channel.stage_channel_axis == -1 and whole.stage_channel_axis is None
    assert judge_reproduction(whole, [{"head": moved}], [{"head": head}], bounds).passed
    q = judge_reproduction(per_channel, [{"head": moved}], [{"head": head}], bounds)
    assert not q.passed and "output head channel 4" in q.findings[0].detail
    with pytest.raises(BundleError, match=r"key postprocess.channel_axis: 0 is the batch axis"):
        _parse(lambda d: d["postprocess"].update(channel_axis=0))


def _boxes_result(d: dict[str, Any], **options: Any) -> None:
    d["task"] = "boxes"
    d["postprocess"]["result"] = {"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores", **options}


def test_the_kinds_documented_result_options_are_manifest_keys_the_kind_reads() -> None:
    """docs/results.md: boxes take `score_threshold` (a padded fixed-size output) and `max_detections`, masks
    `class_id`; the schema refused them ("'graph' was unexpected"), so a padded NMS output could not be served."""
    m = _parse(lambda d: _boxes_result(d, score_threshold=0.3, max_detections=10))
    spec = m.postprocess.result.as_mapping()
    assert spec["score_threshold"] == 0.3 and spec["max_detections"] == 10
    with pytest.raises(BundleError, match=r"key postprocess.result.class_id: applies to masks, not boxes"):
        _parse(lambda d: _boxes_result(d, class_id=1))


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["postprocess"]["result"].update(foo=1), r"key postprocess.result: .*\('foo' was unexpected\)"),
    (lambda d: d["postprocess"].update(bar=1), r"key postprocess: .*\('bar' was unexpected\)"),
    (lambda d: d["postprocess"]["result"].update(top_k=0), r"key postprocess.result.top_k: 0 is less than"),
])
def test_a_schema_error_in_a_post_graph_block_names_the_wrong_key_not_graph(mutate: Callable, message: str) -> None:
    """A post graph's block has no `type`: the schema's error was the classification branch's ("'graph' was
    unexpected"), naming a key that is right and hiding the one that is wrong."""
    with pytest.raises(BundleError, match=message) as info:
        _parse(mutate)
    assert "'graph'" not in str(info.value)
