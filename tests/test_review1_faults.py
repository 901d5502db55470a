"""Faults found by reviewing issues 10 and 11 (verdicts, spec): each test failed on the code before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.errors import BundleError, ContractError
from agent.proof.parity import fidelity_floors, judge_fidelity
from agent.spec.decoders import layout_problems
from agent.spec.manifest import PostprocessSpec
from agent.testing import _save_checked, rewrite_manifest, structured_frames
from tests.test_stateful import stateful_bundle  # noqa: F401  (fixture)

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


def test_yolov5_layout_declared_on_a_yolov8_shaped_output_is_refused() -> None:
    # [1, 84, 8400] is YOLOv8's (4 + classes, anchors); read as yolov5 it decodes 84 "anchors" of 8395 classes
    p = PostprocessSpec(type="detection", layout="yolov5", output="out")
    problems = layout_problems(p, {"out": [1, 84, 8400]})
    assert problems and "yolov8" in problems[0]
    assert layout_problems(p, {"out": [1, 25200, 85]}) == []


# ------------------------------------------------------------------ uint8 models

def _uint8_model(path: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.01).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fw"),
             numpy_helper.from_array(np.zeros(3, np.float32), "fb")]
    nodes = [helper.make_node("Cast", ["input"], ["x"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, "u8", [helper.make_tensor_value_info("input", TensorProto.UINT8, ["batch", 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], initializer=inits)
    return _save_checked(graph, path, 17)


def _u8_inputs(d: Path, preprocess: dict) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(d / "calib.npz", raw=structured_frames(8, SIZE, 1))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(4, SIZE, 2))
    spec = {"name": "u8", "version": 1, "task": "classification",
            "frame": {"kind": "image", "height": SIZE, "width": SIZE, "channels": 3, "color": "rgb"},
            "preprocess": {"layout": "nchw", **preprocess},
            "postprocess": {"type": "classification", "output": "logits", "top_k": 1},
            "selftest": {"latency_budget_ms": {"default": 1000}}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return {"model": _uint8_model(d / "m.onnx"), "spec": d / "spec.yaml", "calibration": d / "calib.npz",
            "golden": d / "golden.npz", "int8": False}


def test_uint8_input_with_a_scale_is_refused_instead_of_truncating_every_pixel_to_zero(tmp_path: Path) -> None:
    from agent.bundle.create import CreateOptions, create_bundle

    args = _u8_inputs(tmp_path, {"dtype": "uint8", "scale": 1 / 255})
    with pytest.raises(BundleError, match="preprocess"):
        create_bundle(CreateOptions(out=tmp_path / "b", **args))
    assert not (tmp_path / "b").exists()


def test_preprocess_dtype_that_is_not_the_models_input_dtype_breaks_the_contract_at_load(tmp_path: Path) -> None:
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.bundle.load import load_bundle

    b = create_bundle(CreateOptions(out=tmp_path / "b", **_u8_inputs(tmp_path / "in", {"dtype": "uint8"})))
    load_bundle(b)
    bad = tmp_path / "bad"
    shutil.copytree(b, bad)
    rewrite_manifest(bad, lambda m: m["preprocess"].__setitem__("dtype", "float32"))
    with pytest.raises(ContractError, match="preprocess.dtype"):
        load_bundle(bad)


def test_bundle_create_names_preprocess_dtype_when_it_is_not_the_models_input_dtype(tmp_path: Path) -> None:
    from agent.bundle.create import CreateOptions, create_bundle

    args = _u8_inputs(tmp_path, {"dtype": "float32"})
    with pytest.raises(BundleError, match="preprocess.dtype"):
        create_bundle(CreateOptions(out=tmp_path / "b", **args))


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


# ------------------------------------------------------------------ non-finite outputs in serving

def _strict(result: dict) -> dict:
    import json

    def refuse(name: str) -> None:
        raise ValueError(f"non-finite {name} in a result")

    return json.loads(json.dumps(result, allow_nan=True), parse_constant=refuse)


def test_non_finite_end2end_boxes_decode_to_a_strict_json_result_not_an_exception() -> None:
    # decode raised ValueError("Out of range float values..."), which the publisher does not catch
    from agent.spec.decoders import decode

    p = PostprocessSpec(type="detection", layout="end2end", output="o")
    o = np.array([[[1, 2, 3, 4, 0.9, 0], [np.nan, 2, 3, 4, 0.8, 1], [np.inf, 0, 5, 5, 0.7, 2],
                   [1, 1, 2, 2, np.nan, 0]]], np.float32)
    result = _strict(decode(p, {"o": o}))
    assert [d["class_id"] for d in result["detections"]] == [0]


def test_an_infinite_probability_map_decodes_to_a_strict_json_result_not_an_exception() -> None:
    from agent.spec.decoders import decode

    p = PostprocessSpec(type="segmentation", output="m", mask="rle")
    m = np.zeros((1, 1, 32, 32), np.float32)
    m[0, 0, 2:10, 2:10] = 0.9
    m[0, 0, 20:30, 20:30] = np.inf
    result = _strict(decode(p, {"m": m}))
    assert len(result["regions"]) == 2


# ------------------------------------------------------------------ the spec's floors at build time

@pytest.mark.parametrize("fidelity, message", [
    ({"min_top1_agreemnt": 0.5}, "min_top1_agreemnt"),  # was a bare TypeError from FidelityFloors
    ({"min_top1_agreement": 1.5}, "min_top1_agreement: 1.5 is greater than the maximum of 1"),  # was a quality refusal of fp32
])
def test_a_misspelt_or_out_of_range_floor_in_the_spec_is_a_spec_error_naming_the_key(
        tmp_path: Path, fidelity: dict, message: str) -> None:
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_classifier

    np.savez_compressed(tmp_path / "calib.npz", raw=structured_frames(8, 32, 1))
    np.savez_compressed(tmp_path / "golden.npz", raw=structured_frames(4, 32, 2))
    spec = {"name": "t", "version": 1, "task": "classification",
            "frame": {"kind": "image", "height": 32, "width": 32, "channels": 3, "color": "rgb"},
            "preprocess": {"layout": "nchw", "dtype": "float32", "scale": 1 / 255},
            "postprocess": {"type": "classification", "output": "logits", "top_k": 1},
            "selftest": {"fidelity": fidelity}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(BundleError, match="key selftest.fidelity") as err:
        create_bundle(CreateOptions(model=make_tiny_classifier(tmp_path / "m.onnx"), spec=tmp_path / "spec.yaml",
                                    calibration=tmp_path / "calib.npz", golden=tmp_path / "golden.npz",
                                    out=tmp_path / "b", int8=False))
    assert message in str(err.value)


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


# ------------------------------------------------------------------ fit_multiple on odd frames

def test_fit_multiple_min_refuses_a_skinny_frame_instead_of_allocating_a_gigantic_input() -> None:
    from agent.errors import PreprocessError
    from agent.spec.manifest import FrameSpec, PreprocessSpec, ResizeSpec
    from agent.spec.preprocess import Preprocessor

    r = ResizeSpec(mode="fit_multiple", limit_side=960, limit_type="min", multiple=32)
    pre = Preprocessor(PreprocessSpec(layout="nchw", dtype="float32", resize=r, scale=1 / 255),
                       FrameSpec("image", 0, 0, 3, "rgb"))
    with pytest.raises(PreprocessError, match="aspect too extreme"):
        pre(np.zeros((3, 700, 3), np.uint8))  # was a 960x224000 float tensor (2.5 GB)
    assert pre(np.zeros((1, 1, 3), np.uint8)).shape == (1, 3, 960, 960)  # a tiny frame still fits
    assert pre(np.zeros((720, 1280, 3), np.uint8)).shape == (1, 3, 960, 1696)


def test_short_side_crop_wider_than_the_short_side_is_refused() -> None:
    # a portrait frame made a (224, 22) tensor from the last 22 columns: the crop offset went negative
    from agent.spec.manifest import ResizeSpec, resize_problem

    assert "short_side 256" in (resize_problem(ResizeSpec(mode="short_side_crop", width=300, height=224,
                                                          short_side=256)) or "")
    assert resize_problem(ResizeSpec(mode="short_side_crop", width=224, height=224, short_side=256)) is None


@pytest.mark.parametrize("arrays, key", [
    ({"reference.logits": np.zeros((4, 4), np.float32)}, "'reference.logits' has 4 samples"),  # was IndexError
    ({"label": np.zeros(3, np.int64)}, "'label' has 3 samples"),  # was a numpy broadcast ValueError
])
def test_a_sample_set_whose_references_or_labels_miss_rows_is_refused_naming_the_key(
        tmp_path: Path, arrays: dict, key: str) -> None:
    from agent.bundle.samples import load_samples
    from agent.spec.manifest import FrameSpec

    np.savez_compressed(tmp_path / "set.npz", raw=structured_frames(6, 32, 2), **arrays)
    with pytest.raises(BundleError, match=key):
        load_samples(tmp_path / "set.npz", FrameSpec("image", 32, 32, 3, "rgb"))


def test_a_metadata_input_without_a_default_is_refused_instead_of_feeding_nan(tiny_bundle: Path) -> None:
    from agent.bundle.load import load_bundle

    rewrite_manifest(tiny_bundle, lambda m: m.__setitem__(
        "inputs", [{"name": "gain", "kind": "metadata", "dtype": "float32", "shape": [1]}]))
    with pytest.raises(BundleError, match=r"inputs\[0\]\.default"):
        load_bundle(tiny_bundle)


# ------------------------------------------------------------------ one-output (binary) classifiers

def test_a_one_logit_classifier_is_binary_so_an_inverted_variant_fails_fidelity() -> None:
    # softmax of one value is always 1.0: every frame was "class 0, score 1.0" and any variant agreed
    from agent.spec.decoders import decode

    spec = PostprocessSpec(type="classification", output="p")
    x = np.random.default_rng(0).normal(0, 3, 32).astype(np.float32)
    ref = [{"p": np.array([v], np.float32)} for v in x]
    got = [{"p": -r["p"]} for r in ref]
    r = judge_fidelity(spec, got, ref, fidelity_floors("classification"))
    assert not r.passed
    assert decode(spec, {"p": np.array([4.0], np.float32)})["top"][0]["class_id"] == 1
    assert decode(spec, {"p": np.array([-4.0], np.float32)})["top"][0]["class_id"] == 0
    assert decode(spec, {"p": np.array([-4.0], np.float32)})["top"][0]["score"] == pytest.approx(0.982, abs=1e-3)
