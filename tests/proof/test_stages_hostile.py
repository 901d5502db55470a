"""Stage graphs a careless or hostile bundle author could ship: each fault is refused for the one frame it breaks,
as a stage error the serving pipeline counts (PreprocessError, StageOutputError), never an error that stops it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from stage_graphs import native_pre

from agent.errors import PreprocessError, StageOutputError
from agent.proof.stages import GraphPostprocessor, GraphPreprocessor
from agent.vocabulary.manifest import FrameSpec, PostprocessSpec, PreprocessSpec, ResultSpec, TensorSpec, result_from_dict
from agent.vocabulary.preprocess import IDENTITY
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate

FP32 = Candidate(CPU, "fp32", "fp32")


def _tokens_post(path: Path, length: int) -> Path:
    """x float [1, T] -> tokens int64 [T] (the ids as given: a CTC collapse already done)."""
    nodes = [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.INT64),
             helper.make_node("Squeeze", ["t"], ["tokens"])]
    graph = helper.make_graph(nodes, "tokens_post", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, length])],
                              [helper.make_tensor_value_info("tokens", TensorProto.INT64, [length])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_text_token_beyond_the_charset_at_serving_is_a_stage_error_the_pipeline_counts(tmp_path: Path) -> None:
    spec = PostprocessSpec(graph="post.onnx", result=ResultSpec(kind="text", options={"charset": "charset.txt"}))
    post = GraphPostprocessor(_tokens_post(tmp_path / "post.onnx", 4), spec, (), ["_", "a", "b"])
    assert post.decode({"x": np.array([1, 2, 0, 1], np.float32)}, IDENTITY, 65536)["text"] == "aba"
    with pytest.raises(StageOutputError, match=r"stage post \(post\.onnx\).*token id 7 is beyond the charset"):
        post.decode({"x": np.array([1, 7, 0, 1], np.float32)}, IDENTITY, 65536)


def test_pre_graph_output_whose_shape_is_not_the_fixed_model_input_is_refused_naming_stage_pre(tmp_path: Path) -> None:
    frame = FrameSpec(kind="image", height=0, width=0, channels=3, min_size=(8, 8), max_size=(64, 64))
    model_input = TensorSpec("images", "float32", (1, 3, 32, 32))
    pre = GraphPreprocessor(native_pre(tmp_path / "pre.onnx", "images"), frame, PreprocessSpec(graph="pre.onnx"),
                            model_input)
    assert pre(np.zeros((32, 32, 3), np.uint8)).shape == (1, 3, 32, 32)
    # a native-resolution graph for a fixed-size model: the frames of another size make a tensor the model cannot
    # take (and frames of two sizes in one batch could not be stacked)
    with pytest.raises(PreprocessError, match=r"stage pre.*\[1, 3, 40, 32\].*\[1, 3, 32, 32\]"):
        pre(np.zeros((40, 32, 3), np.uint8))


def _aux_bundle(d: Path, frames: list[np.ndarray]) -> tuple[Any, Path]:
    """The two-output model (`scores` [B, 3] channel mixes, `aux` NaN) as a raw bundle that uses `scores` only;
    the golden frames are `frames` (PNGs in d/golden), the folder a pipeline can serve."""
    import cv2
    import yaml
    from stage_graphs import two_output_model

    from agent.bundle.create import CreateOptions, create_bundle
    from agent.bundle.load import load_bundle

    golden = d / "golden"
    golden.mkdir()
    for i, f in enumerate(frames):
        cv2.imwrite(str(golden / f"{i:03d}.png"), f)
    spec = {"name": "aux", "version": 1, "task": "raw",
            "frame": {"kind": "image", "height": 32, "width": 32, "channels": 3, "color": "rgb"},
            "preprocess": {"scale": 1 / 255, "layout": "nchw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "channel_axis": -1, "uses": ["scores"]}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return load_bundle(create_bundle(CreateOptions(model=two_output_model(d / "m.onnx"), spec=d / "spec.yaml",
                                                   calibration=golden, golden=golden, out=d / "b", int8=False))), golden


def _serve_folder(engine: Any, folder: Path) -> tuple[Any, Any]:
    from agent.config import PipelineConfig, SourceConfig
    from agent.serving.pipeline import Pipeline
    from agent.serving.sources import is_lossless, open_source
    from agent.testing import ListSink

    scfg = SourceConfig(type="folder", path=folder)
    source = open_source(scfg, engine.bundle.manifest.frame, engine.bundle.manifest.preprocess.resize)
    sink = ListSink()
    p = Pipeline(source, engine, sink, PipelineConfig(), is_lossless(scfg, source)).start()
    assert p.done.wait(60), "the pipeline did not finish the folder"
    assert p.join(timeout=15)
    source.close()
    return p, sink


def test_an_unused_non_finite_model_output_never_drops_the_frames_served(tmp_path: Path) -> None:
    """`postprocess.uses: [scores]`: the NaN `aux` output is never judged at build or in the self-test, so serving
    must not drop every frame as non-finite for it either (the bundle proved, then served nothing)."""
    from agent.serving.engine import build_engine
    from agent.testing import structured_frames

    b, golden = _aux_bundle(tmp_path, list(structured_frames(4, 32, 0)))
    p, sink = _serve_folder(build_engine(b, FP32, SessionSettings()), golden)
    assert p.failed is None
    assert p.metrics.inference_errors == 0
    assert len(sink.results) == 4
    assert all(r["result"]["type"] == "raw" and set(r["result"]["outputs"]) == {"scores"} for r in sink.results)


def test_results_a_post_stage_refuses_are_tallied_and_fail_probation(tmp_path: Path) -> None:
    """A post graph whose outputs its kind refuses on some real frames (token ids beyond the charset on the bright
    ones): those frames are dropped and counted against the engine, and probation fails it (it passed: only
    preprocessing refusals and inference errors were evidence)."""
    import dataclasses

    from agent.serving.engine import build_engine
    from agent.updates.probation import ProbationEvidence, judge_probation

    dark, bright = np.zeros((32, 32, 3), np.uint8), np.full((32, 32, 3), 255, np.uint8)
    b, golden = _aux_bundle(tmp_path, [dark, bright, dark, bright])
    # tokens = scores * 10: 0 (the blank) on a dark frame; 3, 13, 23 on a bright one, beyond a 4-entry charset
    nodes = [helper.make_node("Constant", [], ["ten"], value=numpy_helper.from_array(np.array(10, np.float32), "ten")),
             helper.make_node("Mul", ["scores", "ten"], ["x"]),
             helper.make_node("Cast", ["x"], ["t"], to=TensorProto.INT64),
             helper.make_node("Squeeze", ["t"], ["tokens"])]
    graph = helper.make_graph(nodes, "ids", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("tokens", TensorProto.INT64, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "post.onnx"))
    post = GraphPostprocessor(tmp_path / "post.onnx", PostprocessSpec(
        graph="post.onnx", result=ResultSpec(kind="text", options={"charset": "charset.txt"})), (), ["_", "a", "b", "c"])
    engine = dataclasses.replace(build_engine(b, FP32, SessionSettings()), postprocessor=post)
    p, sink = _serve_folder(engine, golden)
    tally = p.tally(engine)
    assert p.failed is None
    assert len(sink.results) == 2 and all(r["result"]["text"] == "" for r in sink.results)
    assert tally.post_refused == 2 and p.drops.get("post_stage_refused") == 2
    v = judge_probation(ProbationEvidence(1.0, tally.frames, tally.results, tally.refused, tally.inference_errors,
                                          tally.non_finite, None, None, post_refused=tally.post_refused))
    assert not v.passed and "2 results refused by its post stage (postprocess.graph)" in v.reasons

def _padded_boxes_post(path: Path, rows: int | str) -> Path:
    """head [1, rows, 5] (x1, y1, x2, y2, score; a fixed-size output padded with score 0) -> det_boxes, det_scores."""
    nodes = [helper.make_node("Constant", [], ["sp"], value=numpy_helper.from_array(np.array([4, 1], np.int64), "sp")),
             helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0], np.int64), "ax")),
             helper.make_node("Constant", [], ["ax1"], value=numpy_helper.from_array(np.array([1], np.int64), "ax1")),
             helper.make_node("Squeeze", ["head", "ax"], ["h"]),
             helper.make_node("Split", ["h", "sp"], ["det_boxes", "s2"], axis=1),
             helper.make_node("Squeeze", ["s2", "ax1"], ["det_scores"])]
    graph = helper.make_graph(nodes, "padded_post", [helper.make_tensor_value_info("head", TensorProto.FLOAT, [1, rows, 5])],
                              [helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, [rows, 4]),
                               helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, [rows])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_padded_fixed_size_boxes_output_serves_only_rows_over_the_declared_score_threshold(tmp_path: Path) -> None:
    """postprocess.result.score_threshold (docs/results.md), read from the manifest as the kind reads it."""
    result = result_from_dict({"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores",
                               "score_threshold": 0.25, "max_detections": 1})
    post = GraphPostprocessor(_padded_boxes_post(tmp_path / "post.onnx", 4),
                              PostprocessSpec(graph="post.onnx", result=result), ("face",), None)
    head = np.zeros((4, 5), np.float32)
    head[0] = [1, 2, 10, 20, 0.6]
    head[2] = [5, 5, 9, 9, 0.9]
    served = post.decode({"head": head}, IDENTITY, 65536)
    assert served == {"type": "boxes", "boxes": [{"box": [5.0, 5.0, 9.0, 9.0], "score": 0.9, "class_id": 0,
                                                  "label": "face"}]}


def test_pre_graph_geometry_knows_the_model_input_size_so_a_strided_map_maps_back_to_frame_pixels(
        tmp_path: Path) -> None:
    """A pre graph (40x40 frame stretched to 32x32) with the vocabulary's segmentation decoder on a stride-4 map
    (8x8): the decoder scales map pixels to input pixels by the geometry's input size, which the pre graph's
    geometry left at 0, so regions were served 4x too small, on both sides of a self-test without answers."""
    from stage_graphs import stretch_pre

    from agent.vocabulary.decoders import decode
    from agent.vocabulary.preprocess import Geometry

    frame = FrameSpec(kind="image", height=40, width=40, channels=3)
    pre = GraphPreprocessor(stretch_pre(tmp_path / "pre.onnx", "images", 32, 32), frame,
                            PreprocessSpec(graph="pre.onnx"), TensorSpec("images", "float32", (1, 3, 32, 32)))
    g = pre.geometry(np.zeros((40, 40, 3), np.uint8))
    assert (g.input_w, g.input_h, g.frame_w, g.frame_h) == (32, 32, 40, 40)
    prob = np.zeros((1, 8, 8), np.float32)
    prob[0, 2:4, 2:6] = 0.9  # map pixels x 2..6, y 2..4 -> input pixels x 8..24, y 8..16 -> frame x 10..30, y 10..20
    spec = PostprocessSpec(type="segmentation", output="map", threshold=0.5, min_area=1)
    vocabulary = Geometry(0.8, 0.8, 0.0, 0.0, frame_w=40, frame_h=40, input_w=32, input_h=32)
    want = decode(spec, {"map": prob}, (), vocabulary, 65536)["regions"]
    assert want[0]["box"] == pytest.approx([10, 10, 30, 20])
    assert decode(spec, {"map": prob}, (), g, 65536)["regions"] == want


def _mask_post(path: Path, size: int) -> Path:
    """map float [1, 1, size, size] -> mask [size, size] (the model's map as is: no resize to the frame)."""
    nodes = [helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([0, 1], np.int64), "ax")),
             helper.make_node("Squeeze", ["map", "ax"], ["mask"])]
    graph = helper.make_graph(nodes, "mask_post", [helper.make_tensor_value_info("map", TensorProto.FLOAT,
                                                                                  [1, 1, size, size])],
                              [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [size, size])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_mask_not_at_the_frame_size_is_refused_by_the_kind_naming_both_sizes(tmp_path: Path) -> None:
    """Kind masks serves `mask` at frame size: a post graph that forgets to resize the model's 32x32 map to the
    48x64 frame served a 32x32 mask in the wrong pixels (unseen by a self-test without answers)."""
    from agent.vocabulary.preprocess import Geometry

    result = ResultSpec(kind="masks", options={"threshold": 0.5})
    post = GraphPostprocessor(_mask_post(tmp_path / "post.onnx", 32), PostprocessSpec(graph="post.onnx", result=result),
                              (), None)
    prob = np.zeros((1, 32, 32), np.float32)
    prob[0, 4:8, 4:8] = 0.9
    at_input = Geometry(1.0, 1.0, 0.0, 0.0, frame_w=32, frame_h=32, input_w=32, input_h=32)
    assert post.decode({"map": prob}, at_input, 65536)["size"] == [32, 32]
    other = Geometry(0.5, 32 / 48, 0.0, 0.0, frame_w=64, frame_h=48, input_w=32, input_h=32)
    with pytest.raises(StageOutputError, match=r"field 'mask' has shape \[32, 32\]: the frame is \[48, 64\]"):
        post.decode({"map": prob}, other, 65536)


def test_a_variant_whose_post_stage_refuses_a_golden_sample_is_rejected_at_build_not_the_whole_build(
        tmp_path: Path) -> None:
    """`bundle create` judges each variant's final result: an INT8 whose outputs the post stage refuses on one golden
    sample (a token beyond the charset) aborted the whole build with StageOutputError; FP32 could still serve."""
    from agent.bundle.variant_judges import GoldenStages, judge_final_results

    post = GraphPostprocessor(_tokens_post(tmp_path / "post.onnx", 4), PostprocessSpec(
        graph="post.onnx", result=ResultSpec(kind="text", options={"charset": "charset.txt"})), (), ["_", "a", "b"])
    spec = {"postprocess": {"graph": "post.onnx", "result": {"kind": "text", "charset": "charset.txt"}}}
    references = [{"x": np.array([[1, 2, 0, 1]], np.float32)}, {"x": np.array([[2, 2, 0, 1]], np.float32)}]
    int8 = [references[0], {"x": np.array([[2, 9, 0, 1]], np.float32)}]
    stages = GoldenStages(None, post, [IDENTITY, IDENTITY], [None, None])
    figures, findings = judge_final_results(stages, int8, [IDENTITY, IDENTITY], references, None, spec, "build golden")
    assert len(findings) == 1
    f = findings[0]
    assert (f.stage, f.sample) == ("post", 1) and "token id 9 is beyond the charset" in f.text()
    assert judge_final_results(stages, references, [IDENTITY, IDENTITY], references, None, spec, "build golden")[1] == []


def test_the_audit_never_judges_a_model_output_the_bundle_does_not_use(tmp_path: Path) -> None:
    """The canary and the live audit judged every output: the unused NaN `aux` made a healthy engine DEGRADED
    ("canary audit drifted"), and the controller re-proves on each drift."""
    from auditing import audited

    from agent.serving.engine import build_engine
    from agent.testing import structured_frames

    b, _golden = _aux_bundle(tmp_path, list(structured_frames(4, 32, 0)))
    auditor = audited(build_engine(b, FP32, SessionSettings()), 32, 6)
    assert auditor.counters["canary_runs"] >= 5 and auditor.counters["live_windows"] >= 2
    assert auditor.counters["canary_failures"] == 0 and auditor.counters["live_drift"] == 0
    assert auditor.degraded is None


def test_the_self_test_batches_and_concurrent_callers_never_judge_an_unused_output(tmp_path: Path) -> None:
    """The self-test judged only the used outputs at batch 1, but its batch-size and concurrent-caller checks
    compared every output: on a device that batches (or runs two inference workers) the unused NaN `aux` failed
    every candidate."""
    from agent.proof.selftest import evaluate
    from agent.testing import structured_frames

    b, _golden = _aux_bundle(tmp_path, list(structured_frames(4, 32, 0)))
    for kw in ({"max_batch": 4}, {"workers": 2}):
        r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False, **kw)
        assert r.passed, (kw, r.reason if hasattr(r, "reason") else r)


def test_the_size_extremes_gate_at_build_never_judges_an_unused_output(tmp_path: Path) -> None:
    """`bundle create`'s check of each variant at the declared size extremes compared every output: the unused
    NaN `aux` refused any variant there."""
    import onnxruntime as ort

    from agent.bundle.variant_judges import GoldenStages, judge_sizes
    from agent.proof.parity import fidelity_floors
    from agent.proof.stages import postprocessor_for, preprocessor_for
    from agent.vocabulary.inputs import InputFeeder
    from agent.testing import structured_frames

    b, _golden = _aux_bundle(tmp_path, list(structured_frames(4, 32, 0)))
    sess = ort.InferenceSession(str(b.path(b.manifest.variant("fp32").file)), providers=[CPU])
    spec = {"postprocess": {"type": "raw", "outputs": ["scores"], "channel_axis": -1, "uses": ["scores"]}}
    stages = GoldenStages(preprocessor_for(b), postprocessor_for(b), [], [])
    figures, problems = judge_sizes(sess, sess, [np.full((32, 32, 3), 90, np.uint8)], preprocessor_for(b),
                                    InputFeeder.for_manifest(b.manifest), spec, stages, fidelity_floors("raw"))
    assert problems == []


def test_package_answers_of_another_kind_than_the_bundle_serves_are_refused_naming_both(tmp_path: Path) -> None:
    """answers.json of kind `scores` for a bundle serving `classes`: every sample was "unreadable as scores" and the
    hint sent the author to postprocess.graph or preprocess, not to the answers' kind."""
    import json

    from agent.bundle.create import CreateOptions
    from agent.bundle.variant_judges import check_against_answers
    from agent.errors import BundleError

    answers = json.dumps({"kind": "scores", "package": "pkg 1.0", "produced_by": "run.py",
                          "results": [{"type": "scores", "scores": [0.9], "decisions": ["a"]}]})
    spec = {"task": "classes", "postprocess": {"graph": "post.onnx", "result": {"kind": "classes"}}}
    opts = CreateOptions(model=tmp_path / "m.onnx", spec=tmp_path / "s.yaml", calibration=tmp_path,
                         golden=tmp_path / "golden", out=tmp_path / "b")
    with pytest.raises(BundleError, match=r"golden.*kind 'scores'.*serves kind 'classes' \(postprocess.result.kind\)"):
        check_against_answers(spec, None, [], answers, 1, opts, False)  # type: ignore[arg-type]


def test_a_post_graph_of_200k_boxes_is_refused_as_too_large_before_its_result_is_built(tmp_path: Path) -> None:
    """A raw head served without NMS or a threshold: 200,000 boxes took 5.4 s to make compact and 1.4 s to measure
    (load 6.5) per frame before the publish stage dropped the result as too large; the kind now refuses it first."""
    from agent.errors import ResultTooLargeError

    rows = 200_000
    result = result_from_dict({"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores"})
    post = GraphPostprocessor(_padded_boxes_post(tmp_path / "post.onnx", "rows"),
                              PostprocessSpec(graph="post.onnx", result=result), (), None)
    head = np.tile(np.array([[1, 2, 10, 20, 0.5]], np.float32), (rows, 1))
    with pytest.raises(ResultTooLargeError, match=r"result of 200000 boxes is at least 11200000 bytes, over "
                                                  r"output.max_result_bytes = 65536"):
        post.decode({"head": head}, IDENTITY, 65536)
    assert len(post.decode({"head": head[:10]}, IDENTITY, 65536)["boxes"]) == 10
