"""Task decoders for the layouts real exports have, compact results, and layouts checked at load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.errors import BundleError, ContractError, ResultTooLargeError
from agent.vocabulary.decoders import (decode, decode_detections, layout_problems, nms, result_bytes,
                                 segment_regions)
from agent.vocabulary.manifest import PostprocessSpec, ResizeSpec
from agent.vocabulary.preprocess import fit_geometry
from agent.testing import rewrite_manifest
from nms_reference import nms_reference


def _cxcywh(x1: float, y1: float, x2: float, y2: float) -> list[float]:
    return [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]


def test_yolov8_layout_decodes_4_plus_classes_by_anchors() -> None:
    # [4+C, N] with C=3, N=4: two overlapping class-1 boxes, one class-2 box, one under threshold
    cols = [_cxcywh(10, 10, 50, 50) + [0.1, 0.9, 0.0], _cxcywh(12, 12, 52, 52) + [0.1, 0.8, 0.0],
            _cxcywh(100, 100, 140, 160) + [0.0, 0.0, 0.7], _cxcywh(0, 0, 5, 5) + [0.1, 0.1, 0.1]]
    out = np.asarray(cols, np.float32).T[None]  # (1, 7, 4)
    spec = PostprocessSpec(type="detection", layout="yolov8", output="output0", score_threshold=0.25)
    dets = decode_detections(spec, {"output0": out[0]})
    assert [(d.class_id, round(d.score, 2)) for d in dets] == [(1, 0.9), (2, 0.7)]
    assert np.allclose(dets[0].box, [10, 10, 50, 50])


def test_yolov5_layout_multiplies_objectness_into_class_scores() -> None:
    rows = [_cxcywh(10, 10, 50, 50) + [0.5, 0.9, 0.1], _cxcywh(60, 60, 90, 90) + [0.2, 0.9, 0.1]]
    spec = PostprocessSpec(type="detection", layout="yolov5", output="output", score_threshold=0.25)
    dets = decode_detections(spec, {"output": np.asarray(rows, np.float32)})
    assert len(dets) == 1 and dets[0].class_id == 0 and abs(dets[0].score - 0.45) < 1e-6  # 0.2*0.9 < 0.25


def test_end2end_layout_takes_the_graphs_detections_without_nms() -> None:
    rows = [[10, 10, 50, 50, 0.9, 3], [11, 11, 51, 51, 0.8, 3], [0, 0, 0, 0, 0.0, 0]]
    spec = PostprocessSpec(type="detection", layout="end2end", output="dets", score_threshold=0.25)
    dets = decode_detections(spec, {"dets": np.asarray(rows, np.float32)})
    assert [d.class_id for d in dets] == [3, 3]  # overlapping, but the graph already ran NMS


def test_detections_map_back_to_frame_pixels_through_the_letterbox() -> None:
    g = fit_geometry(320, 640, ResizeSpec(width=640, height=640, mode="letterbox", anchor="center"))
    cols = [_cxcywh(100, 160 + 50, 200, 160 + 150) + [0.9]]
    spec = PostprocessSpec(type="detection", layout="yolov8", output="o")
    result = decode(spec, {"o": np.asarray(cols, np.float32).T}, ("person",), g)
    assert result["detections"][0]["box"] == [100.0, 50.0, 200.0, 150.0]
    assert result["detections"][0]["label"] == "person"


def test_opencv_nms_keeps_the_same_boxes_as_the_hand_written_one_on_1500_boxes() -> None:
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 600, (1500, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(10, 80, (1500, 2))], 1).astype(np.float32)
    scores = rng.uniform(0, 1, 1500).astype(np.float32)
    assert nms(boxes, scores, 0.45) == nms_reference(boxes, scores, 0.45)
    cls = rng.integers(0, 5, 1500)
    want = []
    for c in range(5):
        idx = np.flatnonzero(cls == c)
        want += [int(idx[j]) for j in nms_reference(boxes[idx], scores[idx], 0.45)]
    assert sorted(nms(boxes, scores, 0.45, cls)) == sorted(want)


def _map_with_blobs() -> np.ndarray:
    prob = np.zeros((480, 640), np.float32)
    prob[100:140, 200:300] = 0.9  # a text line
    prob[300:310, 50:60] = 0.6  # a small one
    prob[5:7, 5:7] = 0.99  # 4 pixels: under min_area
    return prob


def test_probability_map_becomes_regions_with_boxes_scores_and_areas() -> None:
    spec = PostprocessSpec(type="segmentation", output="maps", threshold=0.3, min_area=16)
    regions, mask = segment_regions(spec, _map_with_blobs())
    assert [(r.box, round(r.score, 3), r.area) for r in regions] == [
        ((200.0, 100.0, 300.0, 140.0), 0.9, 4000), ((50.0, 300.0, 60.0, 310.0), 0.6, 100)]
    assert mask.sum() == 4000 + 100 + 4


def test_a_stride_4_map_is_scaled_to_the_input_then_to_the_frame() -> None:
    g = fit_geometry(720, 1280, ResizeSpec(mode="fit_multiple", limit_side=960, multiple=32))  # input 960x544
    prob = np.zeros((136, 240), np.float32)
    prob[10:20, 30:60] = 1.0
    spec = PostprocessSpec(type="segmentation", output="maps", min_area=1)
    (r,), _ = segment_regions(spec, prob, g)
    assert np.allclose(r.box, [30 * 4 * 1280 / 960, 10 * 4 * 720 / 544, 60 * 4 * 1280 / 960, 20 * 4 * 720 / 544], atol=1e-3)


def test_map_model_result_is_under_64_kb() -> None:
    # a 480x640 map declared raw used to publish 2.9 MB of JSON per frame
    maps = {"maps": _map_with_blobs()[None, None]}
    raw = decode(PostprocessSpec(type="raw"), maps)
    assert result_bytes(raw) < 64 * 1024 and raw["outputs"]["maps"]["truncated"] is True
    assert raw["outputs"]["maps"]["shape"] == [1, 1, 480, 640] and len(raw["outputs"]["maps"]["values"]) == 64
    seg = decode(PostprocessSpec(type="segmentation", output="maps", mask="rle"), maps)
    assert result_bytes(seg) < 64 * 1024 and len(seg["regions"]) == 2
    assert sum(seg["mask"]["counts"]) == 480 * 640


def test_an_oversize_result_is_an_error_not_a_multi_megabyte_message() -> None:
    noise = (np.random.default_rng(0).random((480, 640)) > 0.5).astype(np.float32)
    spec = PostprocessSpec(type="segmentation", output="maps", mask="rle", min_area=1000)
    with pytest.raises(ResultTooLargeError, match="over output.max_result_bytes = 65536"):
        decode(spec, {"maps": noise})
    assert decode(spec, {"maps": noise}, max_bytes=0)["type"] == "segmentation"  # 0 = no cap, on purpose


def test_raw_results_are_strict_json_even_with_nan() -> None:
    r = decode(PostprocessSpec(type="raw", max_values=4), {"y": np.array([1.0, np.nan, np.inf, 2.0])})
    assert json.loads(json.dumps(r, allow_nan=False))["outputs"]["y"]["values"] == [1.0, None, None, 2.0]


def test_layouts_are_checked_against_the_real_output_shapes() -> None:
    v8 = PostprocessSpec(type="detection", layout="yolov8", output="o")
    assert layout_problems(v8, {"o": [1, 84, 8400]}) == []
    assert "transposed" in layout_problems(v8, {"o": [1, 8400, 84]})[0]
    v5 = PostprocessSpec(type="detection", layout="yolov5", output="o")
    assert layout_problems(v5, {"o": [1, 25200, 85]}) == [] and layout_problems(v5, {"o": [1, 25200, 4]})
    e2e = PostprocessSpec(type="detection", layout="end2end", output="o")
    assert layout_problems(e2e, {"o": ["batch", 300, 6]}) == [] and layout_problems(e2e, {"o": [1, 300, 7]})
    bs = PostprocessSpec(type="detection", boxes_output="b", scores_output="s")
    assert layout_problems(bs, {"b": [1, 100, 4], "s": [1, 100, 80]}) == []
    assert "anchors" in layout_problems(bs, {"b": [1, 100, 4], "s": [1, 99, 80]})[0]


def test_same_tensor_for_boxes_and_scores_is_refused_at_load(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d.update(task="detection", postprocess={
        "type": "detection", "boxes_output": "logits", "scores_output": "logits"}))
    with pytest.raises(BundleError, match=r"bundle\.yaml: key postprocess\.scores_output: 'logits' is also boxes_output"):
        load_bundle(tiny_bundle)


def test_declared_layout_that_does_not_fit_the_variant_is_refused_naming_the_file(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d.update(task="detection", postprocess={
        "type": "detection", "layout": "yolov8", "output": "logits"}))
    with pytest.raises(ContractError, match=r"model_fp32\.onnx: variant 'fp32'.*yolov8 wants a rank-3|rank-3"):
        load_bundle(tiny_bundle)


def test_mask_iou_compares_thresholded_maps() -> None:
    from agent.vocabulary.decoders import mask_iou

    spec = PostprocessSpec(type="segmentation", output="m", threshold=0.5)
    a = np.zeros((1, 1, 10, 10), np.float32)
    a[0, 0, :5] = 0.9  # 50 pixels
    b = np.zeros_like(a)
    b[0, 0, :4] = 0.9  # 40 pixels inside a's
    assert mask_iou(spec, {"m": a[0]}, {"m": b[0]}) == pytest.approx(0.8)
    assert mask_iou(spec, {"m": np.zeros_like(a[0])}, {"m": np.zeros_like(a[0])}) == 1.0


def test_dbnet_style_box_threshold_and_unclip_grow_shrunk_text_kernels() -> None:
    prob = np.zeros((100, 200), np.float32)
    prob[40:50, 50:150] = 0.9  # a shrunk text kernel, 100 x 10
    prob[80:90, 10:20] = 0.4  # a weak region under min_score
    spec = PostprocessSpec(type="segmentation", output="m", threshold=0.3, min_area=1, min_score=0.6, unclip_ratio=1.5)
    (r,), _ = segment_regions(spec, prob)
    d = 100 * 10 * 1.5 / (2 * 110)  # area * ratio / perimeter
    assert np.allclose(r.box, [50 - d, 40 - d, 150 + d, 50 + d], atol=1e-4)


def test_region_score_box_mean_scores_the_box_like_dbnet_and_drops_a_sparse_blob() -> None:
    # A diagonal stroke: its own pixels score 0.9, but its bounding box is mostly background, as in the
    # held-out text frame where the package (box_score_fast, box_thresh 0.5) dropped a blob the agent kept.
    prob = np.zeros((100, 100), np.float32)
    for i in range(20):
        prob[40 + i, 40 + i:43 + i] = 0.9
    pixel = PostprocessSpec(type="segmentation", output="maps", threshold=0.3, min_area=16, min_score=0.5)
    box = PostprocessSpec(type="segmentation", output="maps", threshold=0.3, min_area=16, min_score=0.5,
                          region_score="box_mean")
    (r,), _ = segment_regions(pixel, prob)
    assert round(r.score, 3) == 0.9
    assert segment_regions(box, prob)[0] == []  # mean over the 22x20 box: 60 * 0.9 / 440 = 0.12
    (full,), _ = segment_regions(PostprocessSpec(type="segmentation", output="maps", min_area=16, region_score="box_mean"), prob)
    assert full.score == pytest.approx(60 * 0.9 / (22 * 20), rel=1e-5)


def test_dilation_grows_the_mask_before_regions_like_dbnet_and_its_box_score_counts_the_border() -> None:
    # The held-out text frame the agent kept and the package dropped: DBNet dilates the mask 2x2, so the
    # box takes in a row and a column of background and its mean falls under box_thresh (0.489 < 0.5).
    prob = np.zeros((50, 50), np.float32)
    prob[10:16, 10:20] = 0.6  # 10x6 at 0.6: box mean 0.6; dilated to 11x7: 0.6 * 60 / 77 = 0.47
    common = dict(type="segmentation", output="maps", threshold=0.3, min_area=16, min_score=0.5, region_score="box_mean")
    (r,), _ = segment_regions(PostprocessSpec(**common), prob)
    assert r.box == (10.0, 10.0, 20.0, 16.0) and round(r.score, 3) == 0.6
    assert segment_regions(PostprocessSpec(**common, dilation=2), prob)[0] == []
    (d,), _ = segment_regions(PostprocessSpec(**{**common, "min_score": 0.0}, dilation=2), prob)
    assert d.box == (10.0, 10.0, 21.0, 17.0) and d.score == pytest.approx(0.6 * 60 / 77, rel=1e-5)
