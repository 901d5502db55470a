"""Pre- and post-processing as ONNX stages (issue 21): the demo bundle served the same through graphs, frames of
any size, boxes with keypoints, and stage faults refused naming the stage, the file, the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from stage_graphs import (
    demo_graph_bundle as build_demo_graph_bundle,
    boxes_keypoints_post,
    constant_head_model,
    grid_decode_post,
    stretch_pre,
    yolox_answers,
    yolox_head,
)

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.load import load_bundle
from agent.errors import BundleError, ContractError, PreprocessError, QualityError
from agent.proof.selftest import evaluate
from agent.proof.stages import preprocessor_for
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.vocabulary.preprocess import read_image_file
from agent.testing import rewrite_manifest, structured_frames

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
DEMO_FRAMES = ROOT / "models" / "demo-frames" / "digits"
FP32 = Candidate(CPU, "fp32", "fp32")


def _frames_dir(d: Path, sizes: list[tuple[int, int]], seed: int = 0) -> Path:
    """PNG frames of the given (height, width) sizes."""
    d.mkdir(parents=True, exist_ok=True)
    base = structured_frames(len(sizes), 64, seed)
    for i, (h, w) in enumerate(sizes):
        cv2.imwrite(str(d / f"{i:03d}.png"), cv2.resize(base[i], (w, h), interpolation=cv2.INTER_AREA))
    return d


def _serve(engine, raw: np.ndarray) -> dict:
    """One frame through what the pipeline runs: preprocessor (with geometry), model, decode."""
    tensor, geometry = engine.preprocessor.with_geometry(raw)
    outs = engine.run(tensor)
    return engine.decode({k: v[0] for k, v in outs.items()}, geometry, 65536)


# ---------------------------------------------------------------- the demo bundle through graphs

@pytest.fixture(scope="module", params=["fp32"])
def demo_graph_bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo classifier built with `bundle create --pre-graph --post-graph` (tests/stage_graphs.py)."""
    return build_demo_graph_bundle(tmp_path_factory.mktemp("demo-graph"), int8=request.param == "int8")


def test_demo_bundle_serves_the_same_results_through_equivalent_pre_and_post_graphs(demo_graph_bundle: Path) -> None:
    declarative = build_engine(load_bundle(DEMO), FP32, SessionSettings())
    graphs = build_engine(load_bundle(demo_graph_bundle), FP32, SessionSettings())
    frames = sorted(DEMO_FRAMES.glob("*.png"))
    assert len(frames) == 48
    worst = 0.0
    for p in frames:
        raw = read_image_file(str(p), declarative.bundle.manifest.frame)
        a, b = _serve(declarative, raw), _serve(graphs, raw)
        assert a["type"] == "classification" and b["type"] == "classes"
        assert a["top"][0]["class_id"] == b["top"][0]["class_id"], (p.name, a, b)
        assert a["top"][0]["label"] == b["top"][0]["label"]
        scores_a = {t["class_id"]: t["score"] for t in a["top"]}
        for t in b["top"]:
            if t["class_id"] in scores_a:
                worst = max(worst, abs(t["score"] - scores_a[t["class_id"]]))
    # OpenCV's fixed-point uint8 resize and ONNX Resize round a few pixels apart (by 1 of 255): scores move by
    # far less than the classes kind's score tolerance (0.02)
    assert worst <= 0.02


def test_graph_bundle_self_test_judges_each_stage_and_the_final_result_against_package_answers(
        demo_graph_bundle: Path) -> None:
    b = load_bundle(demo_graph_bundle)
    assert set(b.manifest.files) >= {"pre.onnx", "post.onnx", "golden/answers.json"}
    g = b.golden()
    assert all("post.fp32" in s.stage_outputs and "geometry" in s.stage_outputs["pre"] for s in g)
    r = evaluate(b, FP32, SessionSettings(), g, latency=False)
    assert r.passed, r.reasons
    fid = r.evidence.fidelity
    assert fid.against == "package answers" and not fid.warnings
    assert fid.agreement.metrics["top1_agreement"] == 1.0


def test_tampered_post_graph_fails_reproduction_at_stage_post(demo_graph_bundle: Path, tmp_path: Path) -> None:
    import onnx

    root = tmp_path / "b"
    shutil.copytree(demo_graph_bundle, root)
    model = onnx.load(str(root / "post.onnx"))
    for node in model.graph.node:
        if node.op_type == "Softmax":  # logits scaled by 2 before the softmax: sharper probabilities
            node.input[0] = "doubled"
    two = onnx.helper.make_node("Constant", [], ["two"], value=onnx.numpy_helper.from_array(np.array(2.0, np.float32)))
    mul = onnx.helper.make_node("Mul", ["logits", "two"], ["doubled"])
    model.graph.node.insert(0, mul)
    model.graph.node.insert(0, two)
    onnx.save(model, str(root / "post.onnx"))
    rewrite_manifest(root)
    b = load_bundle(root)
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert not r.passed
    post = [f for f in r.findings if f.stage == "post"]
    assert post and post[0].check == "reproduction", r.reasons
    assert "at stage post" in post[0].text()


def test_stages_merged_into_the_model_by_onnx_compose_reproduce_the_separate_sessions_bit_for_bit(
        demo_graph_bundle: Path, tmp_path: Path) -> None:
    """The premise of scripts/bench_stages.py (and of docs/benchmarks.md's decision not to merge): one session
    of pre + model + post gives what the three sessions give, so the benchmark compares like with like."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_stages", ROOT / "scripts" / "bench_stages.py")
    assert spec is not None and spec.loader is not None
    bench = sys.modules["bench_stages"] = importlib.util.module_from_spec(spec)  # its dataclass needs the entry
    spec.loader.exec_module(bench)
    b = load_bundle(demo_graph_bundle)
    paths = bench.open_paths(b, SessionSettings(), tmp_path)
    assert "pre/geometry" in paths.merged_outputs and "post/probabilities" in paths.merged_outputs
    frames = [s.raw for s in b.golden()]
    assert bench.compare(paths, frames).startswith("bit-exact on 8 frames")


# ---------------------------------------------------------------- frames of any size

def _tiny_pre_bundle(d: Path, golden: Path, **frame: object) -> Path:
    from agent.testing import make_tiny_classifier

    pre = stretch_pre(d / "pre.onnx", "input", 32, 32, 1 / 255, (0.5,), (0.25,))
    spec = {"name": "any-size", "version": 1, "task": "classification",
            "frame": {"kind": "image", "height": 0, "width": 0, "channels": 3, "color": "rgb", **frame},
            "postprocess": {"type": "classification", "output": "logits", "top_k": 2}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return create_bundle(CreateOptions(model=make_tiny_classifier(d / "m.onnx"), spec=d / "spec.yaml",
                                       calibration=golden, golden=golden, out=d / "bundle", int8=False,
                                       pre_graph=pre))


def test_pre_graph_takes_frames_of_two_sizes_within_the_declared_bounds(tmp_path: Path) -> None:
    golden = _frames_dir(tmp_path / "golden", [(40, 40), (48, 64), (40, 40), (48, 64)])
    b = load_bundle(_tiny_pre_bundle(tmp_path, golden, min_size=[16, 16], max_size=[96, 96]))
    pre = preprocessor_for(b)
    small, g_small = pre.with_geometry(np.zeros((40, 40, 3), np.uint8))
    large, g_large = pre.with_geometry(np.zeros((48, 64, 3), np.uint8))
    assert small.shape == large.shape == (1, 3, 32, 32)
    assert (g_small.scale_x, g_small.frame_w) == (pytest.approx(0.8), 40)
    assert (g_large.scale_x, g_large.scale_y, g_large.frame_w, g_large.frame_h) == (
        pytest.approx(0.5), pytest.approx(32 / 48), 64, 48)
    with pytest.raises(PreprocessError, match=r"outside input.frame.min_size \[16, 16\] .. max_size \[96, 96\]"):
        pre(np.zeros((120, 64, 3), np.uint8))
    # both sizes are proven: the golden set holds each, and the candidate passes on them
    assert {s.raw.shape[:2] for s in b.golden()} == {(40, 40), (48, 64)}
    assert evaluate(b, FP32, SessionSettings(), b.golden(), latency=False).passed


def test_frames_of_any_size_without_bounds_are_refused_naming_the_key(tmp_path: Path) -> None:
    golden = _frames_dir(tmp_path / "golden", [(40, 40)])
    with pytest.raises(BundleError, match=r"key input.frame.max_size"):
        _tiny_pre_bundle(tmp_path, golden)


# ---------------------------------------------------------------- boxes with keypoints

def _detector_bundle(d: Path, head: np.ndarray, post_graph: Path | None, postprocess: dict, task: str,
                     golden: Path, allow_unproven_decoder: bool = True) -> Path:
    """allow_unproven_decoder: most tests here prove other things on golden sets without the package's answers
    (tests/test_decoder_unproven.py proves the refusal without the flag)."""
    spec = {"name": "det", "version": 1, "task": task,
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": postprocess}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return create_bundle(CreateOptions(model=constant_head_model(d / "m.onnx", head), spec=d / "spec.yaml",
                                       calibration=golden, golden=golden, out=d / "bundle", int8=False,
                                       post_graph=post_graph, allow_unproven_decoder=allow_unproven_decoder))


def test_post_graph_with_boxes_and_keypoints_is_served_as_kind_boxes_in_frame_pixels(tmp_path: Path) -> None:
    head = np.array([[[4, 8, 12, 16, 0.9, 6, 10, 8, 12],
                      [16, 16, 28, 30, 0.7, 20, 20, 24, 26]]], np.float32)  # input pixels (32x32 of a 40x40 frame)
    golden = _frames_dir(tmp_path / "golden", [(40, 40)] * 3)
    post = boxes_keypoints_post(tmp_path / "post.onnx", "output", 2, 2)
    root = _detector_bundle(tmp_path, head, post, {"result": {"kind": "boxes", "boxes": "det_boxes",
                                                              "scores": "det_scores", "keypoints": "det_kps"}},
                            "boxes", golden)
    b = load_bundle(root)
    engine = build_engine(b, FP32, SessionSettings())
    r = _serve(engine, np.zeros((40, 40, 3), np.uint8))
    assert r["type"] == "boxes" and len(r["boxes"]) == 2
    first = r["boxes"][0]
    assert first["box"] == pytest.approx([5, 10, 15, 20])  # input pixels / 0.8
    assert first["score"] == pytest.approx(0.9)
    assert first["keypoints"] == [pytest.approx([7.5, 12.5]), pytest.approx([10, 15])]
    assert evaluate(b, FP32, SessionSettings(), b.golden(), latency=False).passed


# ---------------------------------------------------------------- stage faults, each named

def test_stage_file_whose_hash_is_wrong_is_refused_naming_the_file(demo_graph_bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(demo_graph_bundle, root)
    with open(root / "pre.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match=r"pre.onnx: hash mismatch"):
        load_bundle(root)


def test_stage_graph_not_listed_in_files_is_refused_naming_the_key(demo_graph_bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(demo_graph_bundle, root)
    text = (root / "bundle.yaml").read_text().replace("graph: post.onnx", "graph: other.onnx")
    (root / "bundle.yaml").write_text(text)
    with pytest.raises(BundleError, match=r"key postprocess.graph: 'other.onnx' is not listed in files"):
        load_bundle(root)


def test_post_graph_missing_a_declared_field_is_refused_naming_the_field_and_the_stage(tmp_path: Path) -> None:
    head = np.zeros((1, 2, 9), np.float32)
    golden = _frames_dir(tmp_path / "golden", [(40, 40)])
    post = boxes_keypoints_post(tmp_path / "post.onnx", "output", 2, 2)
    result = {"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores", "keypoints": "det_landmarks"}
    with pytest.raises(ContractError, match=r"stage post \(postprocess.graph\).*field 'keypoints'.*'det_landmarks'"):
        _detector_bundle(tmp_path, head, post, {"result": result}, "boxes", golden)


# ---------------------------------------------------------------- a wrong decoder against the package's answers

GRID, STRIDE = 4, 8
OBJECTS = [(0, 0, 0.5, 0.5, 12, 12), (2, 1, 0.3, 0.6, 10, 14), (3, 3, 0.5, 0.4, 16, 10)]


def _yolox_golden(d: Path, answers: bool) -> tuple[Path, np.ndarray]:
    head = yolox_head(GRID, STRIDE, OBJECTS)
    golden = _frames_dir(d, [(40, 40)] * 4)
    if answers:
        one = yolox_answers(head, GRID, STRIDE, 32 / 40, 32 / 40)
        (golden / "answers.json").write_text(json.dumps({"kind": "boxes", "package": "yolox-style test head",
                                                         "produced_by": "tests/stage_graphs.py yolox_answers",
                                                         "results": [one] * 4}))
    return golden, head


WRONG = {"type": "detection", "layout": "yolov5", "output": "output", "score_threshold": 0.25}


def test_yolox_head_declared_as_yolov5_builds_with_the_flag_and_passes_against_itself_without_answers(
        tmp_path: Path) -> None:
    """With --allow-unproven-decoder (tests/test_decoder_unproven.py: refused without it): nothing can tell the
    decoder is wrong, and the report says fidelity was judged against our own decoding."""
    golden, head = _yolox_golden(tmp_path / "golden", answers=False)
    b = load_bundle(_detector_bundle(tmp_path, head, None, WRONG, "detection", golden))
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert r.passed
    assert "our own decoding" in r.evidence.fidelity.warnings[0].metric


def test_yolox_head_declared_as_yolov5_with_reference_tensors_only_is_refused_at_build_naming_the_missing_answers(
        tmp_path: Path) -> None:
    """Issue 42: a decoder wrong on both sides agrees with itself ("recall 0.994" against its own decoding), so a
    decoding bundle whose golden set holds no package answers is refused, naming them and the flag."""
    golden, head = _yolox_golden(tmp_path / "golden", answers=False)
    with pytest.raises(BundleError, match=r"refusing the bundle: the decoder \(postprocess.type detection: 'boxes', "
                                          r"layout 'yolov5'\) is not proven: .*golden hold no package answers "
                                          r"\(answers.json.*--allow-unproven-decoder.*source.unproven_decoder"):
        _detector_bundle(tmp_path, head, None, WRONG, "detection", golden, allow_unproven_decoder=False)
    assert not (tmp_path / "bundle").exists()


def test_post_graph_serving_boxes_without_answers_is_refused_naming_the_graph(tmp_path: Path) -> None:
    golden, head = _yolox_golden(tmp_path / "golden", answers=False)
    post = grid_decode_post(tmp_path / "post.onnx", GRID, STRIDE)
    result = {"result": {"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores", "class_ids": "det_classes"}}
    with pytest.raises(BundleError, match=r"decoder \(postprocess.result.kind: 'boxes', post graph 'post.onnx'\) is "
                                          r"not proven"):
        _detector_bundle(tmp_path, head, post, result, "boxes", golden, allow_unproven_decoder=False)


def test_unproven_decoder_built_with_the_flag_carries_the_warning_in_the_manifest_and_the_report(
        tmp_path: Path) -> None:
    golden, head = _yolox_golden(tmp_path / "golden", answers=False)
    b = load_bundle(_detector_bundle(tmp_path, head, None, WRONG, "detection", golden, allow_unproven_decoder=True))
    assert "no package answers" in b.manifest.source["unproven_decoder"]
    from agent.proof.inspect import render_text, summarize

    assert "UNPROVEN DECODER: the decoder (postprocess.type detection: 'boxes', layout 'yolov5') is not proven" in \
        render_text(summarize(b))
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert any("our own decoding" in w.metric for w in r.evidence.fidelity.warnings)


def test_yolox_head_declared_as_yolov5_is_refused_at_build_against_the_package_answers(tmp_path: Path) -> None:
    golden, head = _yolox_golden(tmp_path / "golden", answers=True)
    with pytest.raises(BundleError, match=r"package's own answers \(before quantisation\): fidelity: recall \(pooled "
                                          r"over 4 samples\) = 0 under bound 0.9 on sample 0 at stage post"):
        _detector_bundle(tmp_path, head, None, WRONG, "detection", golden)


def test_yolox_head_declared_wrongly_fails_self_test_fidelity_against_the_bundled_answers(tmp_path: Path) -> None:
    """The fault of issue 21 (boxes near (0, 0), none of the package's found): a bundle built before answers
    existed, given golden/answers.json, is rejected on the device naming stage post, metric, value, bound, sample."""
    golden, head = _yolox_golden(tmp_path / "golden", answers=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    for p in golden.glob("*.png"):
        shutil.copy(p, plain / p.name)
    root = _detector_bundle(tmp_path, head, None, WRONG, "detection", plain)
    shutil.copy(golden / "answers.json", root / "golden" / "answers.json")
    rewrite_manifest(root)
    b = load_bundle(root)
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert not r.passed
    f = next(f for f in r.findings if f.check == "fidelity")
    assert (f.stage, f.value, f.bound, f.sample) == ("post", 0.0, 0.9, 0) and f.metric.startswith("recall"), f.text()
    assert "0 of 12 package boxes matched" in f.detail


def test_yolox_head_with_its_grid_decode_as_post_graph_matches_the_package_answers(tmp_path: Path) -> None:
    golden, head = _yolox_golden(tmp_path / "golden", answers=True)
    post = grid_decode_post(tmp_path / "post.onnx", GRID, STRIDE)
    root = _detector_bundle(tmp_path, head, post, {"result": {"kind": "boxes", "boxes": "det_boxes",
                                                              "scores": "det_scores", "class_ids": "det_classes"}},
                            "boxes", golden)
    b = load_bundle(root)
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert r.passed, r.reasons
    assert r.evidence.fidelity.against == "package answers"
    served = _serve(build_engine(b, FP32, SessionSettings()), np.zeros((40, 40, 3), np.uint8))
    want = yolox_answers(head, GRID, STRIDE, 0.8, 0.8)["boxes"]
    assert [x["box"] for x in served["boxes"]] == [pytest.approx(w["box"], abs=1e-3) for w in want]


@pytest.mark.slow
def test_edge_agent_run_serves_the_demo_frames_the_same_through_the_graph_bundle(demo_graph_bundle: Path,
                                                                                 tmp_path: Path) -> None:
    """`edge-agent run` end to end (self-test, then the serving pipeline: pre graph in the preprocessing
    workers, post graph in the publish stage) against the declarative demo bundle on the same frames."""
    import os
    import subprocess
    import sys

    def run(bundle: Path, name: str) -> list[dict]:
        cfg = {"device_id": f"dev-{name}", "state_dir": str(tmp_path / name), "bundle": str(bundle),
               "source": {"type": "folder", "path": str(DEMO_FRAMES), "loop": False},
               "selection": {"variant": "fp32"}}  # the graph bundle has FP32 only: the same model on both sides
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config",
                              str(tmp_path / f"{name}.yaml")], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    plain, graphs = run(DEMO, "declarative"), run(demo_graph_bundle, "graphs")
    assert len(plain) == len(graphs) == 48
    assert [r["source"] for r in plain] == [r["source"] for r in graphs]
    for a, b in zip(plain, graphs):
        assert b["result"]["type"] == "classes" and b["bundle"]["name"] == "digits-graph"
        assert a["variant"] == b["variant"] == "fp32"
        assert a["result"]["top"][0]["label"] == b["result"]["top"][0]["label"], (a["source"], a, b)
        assert abs(a["result"]["top"][0]["score"] - b["result"]["top"][0]["score"]) <= 0.02


def test_letterbox_of_an_int_truncating_package_is_refused_naming_the_rounding_key(tmp_path: Path) -> None:
    """The package int()s the letterbox's resized side (YOLOX): the drift is explained by
    preprocess.resize.rounding, and the refusal says so (the old hint named preprocess.mean)."""
    from agent.vocabulary.manifest import FrameSpec, preprocess_from_dict
    from agent.vocabulary.preprocess import Preprocessor
    from agent.testing import make_tiny_classifier

    frame = {"kind": "image", "height": 37, "width": 100, "channels": 3, "color": "rgb"}
    pre = {"resize": {"width": 32, "height": 32, "mode": "letterbox"}, "scale": 1 / 255, "layout": "nchw",
           "dtype": "float32"}
    raw = np.stack([cv2.resize(f, (100, 37)) for f in structured_frames(4, 64, 3)])
    package = Preprocessor(preprocess_from_dict({**pre, "resize": {**pre["resize"], "rounding": "floor"}}),
                           FrameSpec(**frame))
    np.savez(tmp_path / "golden.npz", raw=raw, input=np.concatenate([package(r) for r in raw]))
    spec = {"name": "lb", "version": 1, "task": "classification", "frame": frame, "preprocess": pre,
            "postprocess": {"type": "classification", "output": "logits"}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    opts = CreateOptions(model=make_tiny_classifier(tmp_path / "m.onnx"), spec=tmp_path / "spec.yaml",
                         calibration=tmp_path / "golden.npz", golden=tmp_path / "golden.npz", out=tmp_path / "b",
                         int8=False)
    with pytest.raises(BundleError, match=r"stage pre: .*does not reproduce the framework's input tensors.*The key "
                                          r"that explains it: preprocess.resize.rounding: floor \(with it the max abs "
                                          r"is 0, within 0.001\)"):
        create_bundle(opts)
    spec["preprocess"]["resize"]["rounding"] = "floor"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert load_bundle(create_bundle(opts)).manifest.preprocess.resize.rounding == "floor"


def test_yolox_recipe_post_graph_serves_the_package_answers_through_the_engine_and_self_test(tmp_path: Path) -> None:
    """The recipes' post.yolox (agent/bundle/graphs) follows the stage names: as a bundle's post graph it passes
    the self-test against the package's answers and serves their boxes."""
    from agent.bundle.graphs import write_graph

    golden, head = _yolox_golden(tmp_path / "golden", answers=True)
    # this package does not clip its boxes to the frame (clipped, two boxes fall to IoU 0.69 and 0.74 with its
    # answers, and the median-IoU floor refuses the build: localisation is judged, not only a match at 0.5)
    post = write_graph("post.yolox", tmp_path / "post.onnx", {"width": 32, "height": 32, "strides": (STRIDE,),
                                                              "score_threshold": 0.25, "clip": False})
    root = _detector_bundle(tmp_path, head, post, {"result": {"kind": "boxes"}}, "boxes", golden)
    b = load_bundle(root)
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert r.passed and r.evidence.fidelity.against == "package answers", r.reasons
    served = _serve(build_engine(b, FP32, SessionSettings()), np.zeros((40, 40, 3), np.uint8))
    want = yolox_answers(head, GRID, STRIDE, 0.8, 0.8)["boxes"]
    assert sorted(x["box"][0] for x in served["boxes"]) == pytest.approx(sorted(w["box"][0] for w in want), abs=1e-3)


def _coordinate_bundle(d: Path, int8: bool = True) -> tuple[Path, dict]:
    from stage_graphs import native_pre, width_coordinate_model

    golden = _frames_dir(d / "golden", [(32, 32)] * 4)  # the sample set holds one (small) size only
    spec = {"name": "coords", "version": 1, "task": "raw",
            "frame": {"kind": "image", "height": 0, "width": 0, "channels": 3, "color": "rgb",
                      "min_size": [32, 32], "max_size": [32, 128]},
            "postprocess": {"type": "raw", "outputs": ["extent"], "channel_axis": -1}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    opts = CreateOptions(model=width_coordinate_model(d / "m.onnx"), spec=d / "spec.yaml", calibration=golden,
                         golden=golden, out=d / "bundle", int8=int8, pre_graph=native_pre(d / "pre.onnx", "images"),
                         min_agreement=0.5)
    return d, {"opts": opts, "spec": spec, "golden": golden}


def test_any_size_int8_is_calibrated_at_the_largest_declared_frame_not_only_the_sample_sizes(tmp_path: Path) -> None:
    """Issue 21: an INT8 calibrated at one frame size was served at every size, its in-graph coordinates clipped
    to the calibrated range. Calibrated at min_size and max_size too, it keeps the FP32 answer at 32x128."""
    import onnxruntime as ort

    _d, made = _coordinate_bundle(tmp_path)
    root = create_bundle(made["opts"])
    b = load_bundle(root)
    pre = preprocessor_for(b)
    wide = pre(np.full((32, 128, 3), 128, np.uint8))
    fp32, int8 = (ort.InferenceSession(str(root / b.manifest.variant(v).file), providers=[CPU]) for v in ("fp32", "int8"))
    want, got = fp32.run(None, {"images": wide})[0].item(), int8.run(None, {"images": wide})[0].item()
    assert want == pytest.approx(254.5, abs=0.5)
    assert got == pytest.approx(want, rel=0.02), "INT8 clipped at the calibrated width"
    assert b.manifest.variant("int8").quality["size_128x32_findings"] == 0


def test_int8_that_clips_beyond_the_calibrated_size_is_refused_naming_the_frame_size(tmp_path: Path) -> None:
    """The build's check at the declared extremes, given an INT8 calibrated on the small frames alone."""
    import onnxruntime as ort

    from agent.bundle.build_runs import prepare_fp32
    from agent.bundle.quantise import CalibrationFeeds, quantize_int8
    from agent.bundle.variant_judges import GoldenStages, judge_sizes, size_extremes
    from agent.bundle.samples import load_samples
    from agent.proof.parity import fidelity_floors
    from agent.proof.stages import GraphPreprocessor, VocabularyPostprocessor
    from agent.vocabulary.inputs import InputFeeder
    from agent.vocabulary.manifest import TensorSpec, frame_from_dict, postprocess_from_dict, preprocess_from_dict

    d, made = _coordinate_bundle(tmp_path)
    opts, spec = made["opts"], made["spec"]
    frame = frame_from_dict(spec["frame"])
    pre = GraphPreprocessor(opts.pre_graph, frame, preprocess_from_dict({"graph": "pre.onnx"}, "float32"),
                            TensorSpec("images", "float32", (1, 3, "h", "w")))
    prepare_fp32(opts.model, d / "fp32.onnx")
    golden = load_samples(made["golden"], frame)
    feeder = InputFeeder("images", ())
    quantize_int8(d / "fp32.onnx", d / "int8.onnx", CalibrationFeeds(golden.raw, pre, feeder), opts)
    sessions = [ort.InferenceSession(str(d / f), providers=[CPU]) for f in ("int8.onnx", "fp32.onnx")]
    stages = GoldenStages(pre, VocabularyPostprocessor(postprocess_from_dict(spec["postprocess"]), []), [], [])
    figures, problems = judge_sizes(*sessions, size_extremes(frame, golden), pre, feeder, spec, stages,
                                    fidelity_floors("raw"))
    assert figures["size_32x32_findings"] == 0 and figures["size_128x32_findings"] == 1
    assert len(problems) == 1 and "at stage build frame size 128x32 vs fp32" in problems[0]
    assert "fidelity: worst channel SNR dB" in problems[0] and "under bound 15" in problems[0]


def test_golden_answers_that_cannot_fail_recall_are_warned_about_at_build(tmp_path: Path) -> None:
    import structlog

    head = yolox_head(GRID, STRIDE, [])  # no object anywhere: the package's answers hold no box
    golden = _frames_dir(tmp_path / "golden", [(40, 40)] * 2)
    (golden / "answers.json").write_text(json.dumps({"kind": "boxes", "package": "empty", "produced_by": "test",
                                                     "results": [{"type": "boxes", "boxes": []}] * 2}))
    post = grid_decode_post(tmp_path / "post.onnx", GRID, STRIDE)
    with structlog.testing.capture_logs() as events:
        _detector_bundle(tmp_path, head, post, {"result": {"kind": "boxes", "boxes": "det_boxes",
                                                           "scores": "det_scores", "class_ids": "det_classes"}},
                         "boxes", golden)
    warned = [e for e in events if e.get("event") == "bundle.create.golden_cannot_fail"]
    assert warned and "recall and localisation cannot fail" in warned[0]["warning"]


def test_bundle_inspect_names_the_stage_graphs_and_the_package_answers(demo_graph_bundle: Path) -> None:
    from agent.proof.inspect import render_text, summarize

    s = summarize(load_bundle(demo_graph_bundle))
    assert set(s["stages"]) == {"pre", "post"} and s["stages"]["post"]["ops"] == {"Softmax": 1, "Squeeze": 1}
    assert s["answers"] == "golden/answers.json"
    text = render_text(s)
    assert "stages   pre pre.onnx" in text and "package answers: golden/answers.json" in text
    assert "package answers: none" in render_text(summarize(load_bundle(DEMO)))


@pytest.mark.slow
@pytest.mark.parametrize("demo_graph_bundle", ["int8"], indirect=True)
def test_int8_of_a_graph_bundle_quantises_only_the_core_model_and_is_judged_on_its_final_result(
        demo_graph_bundle: Path) -> None:
    import onnx

    b = load_bundle(demo_graph_bundle)
    int8 = b.manifest.variant("int8")
    assert int8.quantization["format"] == "QDQ"
    for stage in ("pre.onnx", "post.onnx"):  # the stages are shipped as given: no quantisation node in them
        assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in onnx.load(str(b.path(stage))).graph.node)
    assert int8.quality["golden_final_top1_agreement"] == 1.0  # judged by the kind against the package's answers
    r = evaluate(b, Candidate(CPU, "int8", "int8"), SessionSettings(), b.golden(), latency=False)
    assert r.evidence.fidelity.against == "package answers"
    assert r.passed, r.reasons  # the build and the device judge the same final result by the same kind


def test_variant_whose_quantisation_made_an_output_dim_concrete_keeps_its_own_recorded_contract(
        tiny_bundle: Path) -> None:
    """Issue 21: an INT8 whose output dims quantisation made concrete "broke the declared contract" after a
    13-minute build. `bundle create` records what each variant really declares (`variants[].outputs`), before
    evaluating it; the device checks the variant against that."""
    import onnx
    import onnxruntime as ort

    from agent.bundle.build_runs import variant_outputs

    m = load_bundle(tiny_bundle).manifest
    path = tiny_bundle / m.variant("int8").file
    model = onnx.load(str(path))
    for o in model.graph.output:
        o.type.tensor_type.shape.dim[0].ClearField("dim_param")
        o.type.tensor_type.shape.dim[0].dim_value = 1  # [batch, C] -> [1, C]
    onnx.save(model, str(path))
    rewrite_manifest(tiny_bundle)
    with pytest.raises(ContractError, match=r"variant 'int8' breaks the declared contract: output 'logits' shape"):
        load_bundle(tiny_bundle)
    declared = [{"name": o.name, "dtype": o.dtype, "shape": list(o.shape)} for o in m.outputs]
    own = variant_outputs(ort.InferenceSession(str(path), providers=[CPU]), declared, "int8", path)
    assert own == [{"name": "logits", "dtype": "float32", "shape": [1, declared[0]["shape"][1]]}]
    assert variant_outputs(ort.InferenceSession(str(tiny_bundle / m.variant("fp32").file), providers=[CPU]),
                           declared, "fp32", path) is None

    def record(d: dict) -> None:
        next(v for v in d["variants"] if v["name"] == "int8")["outputs"] = own

    rewrite_manifest(tiny_bundle, record)
    assert load_bundle(tiny_bundle).manifest.variant("int8").outputs[0].shape == (1, declared[0]["shape"][1])


def test_sensor_window_pre_graph_serves_what_the_declarative_front_end_serves(tiny_sensor_bundle: Path,
                                                                              tmp_path: Path) -> None:
    """A pre graph takes a sensor window (samples x channels) as well: the tiny sensor bundle's (x - 0) / 2 in NCW
    as a graph serves the very same results on its golden windows."""
    from tests.conftest import TINY_SENSOR_SPEC
    from stage_graphs import window_pre

    from agent.testing import make_tiny_sensor_model

    spec = {k: v for k, v in TINY_SENSOR_SPEC.items() if k != "preprocess"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**spec, "name": "sensor-graph"}))
    windows = np.stack([g.raw for g in load_bundle(tiny_sensor_bundle).golden()])
    np.savez(tmp_path / "golden.npz", raw=windows)
    root = create_bundle(CreateOptions(model=make_tiny_sensor_model(tmp_path / "s.onnx"), spec=tmp_path / "spec.yaml",
                                       calibration=tmp_path / "golden.npz", golden=tmp_path / "golden.npz",
                                       out=tmp_path / "b", int8=False,
                                       pre_graph=window_pre(tmp_path / "pre.onnx", "window", 64, 3, 2.0)))
    graphs = build_engine(load_bundle(root), FP32, SessionSettings())
    declarative = build_engine(load_bundle(tiny_sensor_bundle), FP32, SessionSettings())
    for w in windows:
        assert _serve(graphs, w) == _serve(declarative, w)
    with pytest.raises(PreprocessError, match=r"sensor window shape \(32, 3\) is not \(64, 3\)"):
        graphs.preprocessor(windows[0][:32])
    b = load_bundle(root)
    assert evaluate(b, FP32, SessionSettings(), b.golden(), latency=False).passed


def test_self_test_proves_each_candidate_at_the_declared_size_extremes(tmp_path: Path) -> None:
    """The frames at min_size and max_size travel in the golden set with each variant's outputs there; a candidate
    that computes something else at the largest size (here: the recorded INT8 answer of a saturating build) fails
    reproduction naming the frame size."""
    _d, made = _coordinate_bundle(tmp_path)
    root = create_bundle(made["opts"])
    b = load_bundle(root)
    probes = b.golden()[0].size_probes
    assert [p[0].shape for p in probes] == [(32, 32, 3), (32, 128, 3)] and set(probes[1][1]) == {"fp32", "int8"}
    assert evaluate(b, Candidate(CPU, "int8", "int8"), SessionSettings(), b.golden(), latency=False).passed
    sample = root / b.manifest.golden[0]
    with np.load(sample) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["size.1.variant.int8.extent"] = np.full_like(arrays["size.1.variant.int8.extent"], 62.5)
    np.savez(sample, **arrays)
    rewrite_manifest(root)
    b = load_bundle(root)
    r = evaluate(b, Candidate(CPU, "int8", "int8"), SessionSettings(), b.golden(), latency=False)
    assert not r.passed
    f = next(f for f in r.findings if f.stage.startswith("frame size"))
    assert f.stage == "frame size 128x32" and f.check == "reproduction", f.text()


def test_outputs_the_bundle_does_not_use_are_never_judged_at_build_or_on_the_device(tmp_path: Path) -> None:
    """Issue 21: "the bundle declares which model outputs it uses (the rest are never judged)". An auxiliary
    output that is NaN refused the bundle; with `postprocess.uses: [scores]` it builds and proves."""
    from stage_graphs import two_output_model

    golden = _frames_dir(tmp_path / "golden", [(32, 32)] * 4)
    model = two_output_model(tmp_path / "m.onnx")

    def build(uses: list[str] | None, out: str) -> Path:
        post = {"type": "raw", "outputs": ["scores"], "channel_axis": -1, **({"uses": uses} if uses else {})}
        spec = {"name": "aux", "version": 1, "task": "raw",
                "frame": {"kind": "image", "height": 32, "width": 32, "channels": 3, "color": "rgb"},
                "preprocess": {"scale": 1 / 255, "layout": "nchw", "dtype": "float32"}, "postprocess": post}
        (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(spec))
        return create_bundle(CreateOptions(model=model, spec=tmp_path / f"{out}.yaml", calibration=golden,
                                           golden=golden, out=tmp_path / out, int8=False))

    with pytest.raises(QualityError, match=r"non-finite output aux"):
        build(None, "all")
    b = load_bundle(build(["scores"], "used"))
    assert b.manifest.used_outputs == ("scores",)
    assert evaluate(b, FP32, SessionSettings(), b.golden(), latency=False).passed
