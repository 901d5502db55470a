"""Faults of the bundle spec and its preprocessing vocabulary (found reviewing issues 10 and 11): each
test failed on the code before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.errors import BundleError, ContractError
from agent.testing import _save_checked, rewrite_manifest, structured_frames

SIZE = 16


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


# ------------------------------------------------------------------ fit_multiple on odd frames

def test_fit_multiple_min_refuses_a_skinny_frame_instead_of_allocating_a_gigantic_input() -> None:
    from agent.errors import PreprocessError
    from agent.vocabulary.manifest import FrameSpec, PreprocessSpec, ResizeSpec
    from agent.vocabulary.preprocess import Preprocessor

    r = ResizeSpec(mode="fit_multiple", limit_side=960, limit_type="min", multiple=32)
    pre = Preprocessor(PreprocessSpec(layout="nchw", dtype="float32", resize=r, scale=1 / 255),
                       FrameSpec("image", 0, 0, 3, "rgb"))
    with pytest.raises(PreprocessError, match="aspect too extreme"):
        pre(np.zeros((3, 700, 3), np.uint8))  # was a 960x224000 float tensor (2.5 GB)
    assert pre(np.zeros((1, 1, 3), np.uint8)).shape == (1, 3, 960, 960)  # a tiny frame still fits
    assert pre(np.zeros((720, 1280, 3), np.uint8)).shape == (1, 3, 960, 1696)


def test_short_side_crop_wider_than_the_short_side_is_refused() -> None:
    # a portrait frame made a (224, 22) tensor from the last 22 columns: the crop offset went negative
    from agent.vocabulary.manifest import ResizeSpec
    from agent.vocabulary.manifest_checks import resize_problem

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
    from agent.vocabulary.manifest import FrameSpec

    np.savez_compressed(tmp_path / "set.npz", raw=structured_frames(6, 32, 2), **arrays)
    with pytest.raises(BundleError, match=key):
        load_samples(tmp_path / "set.npz", FrameSpec("image", 32, 32, 3, "rgb"))


def test_a_metadata_input_without_a_default_is_refused_instead_of_feeding_nan(tiny_bundle: Path) -> None:
    from agent.bundle.load import load_bundle

    rewrite_manifest(tiny_bundle, lambda m: m.__setitem__(
        "inputs", [{"name": "gain", "kind": "metadata", "dtype": "float32", "shape": [1]}]))
    with pytest.raises(BundleError, match=r"inputs\[0\]\.default"):
        load_bundle(tiny_bundle)
