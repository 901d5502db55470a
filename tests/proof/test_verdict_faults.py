"""The fault catalogue of issue 10, on real models, real `bundle create` and real ONNX Runtime sessions:
a whole-graph INT8 that drowns a detector's scores, a map whose reference is ~1e-7, a NaN output,
`--keep-low-quality` that must never lower a floor, strict JSON from `selftest --json`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.load import load_bundle
from agent.errors import QualityError
from agent.proof.selection import SelectionPolicy
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.testing import _save_checked, rewrite_manifest, scale_initializer, structured_frames

FAST = SelftestOptions(latency_runs=10, use_cache=False)
SIZE = 16


def make_concat_head_detector(path: Path, anchors_side: int = SIZE, seed: int = 0) -> Path:
    """A YOLO-like single-output head: [batch, 4 + 2, anchors], box coordinates 0..330 (sigmoid * 330)
    concatenated with class scores 0..1 (sigmoid). Whole-graph uint8 QDQ puts both under one scale."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.5).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((4, 8, 1, 1)) * 0.8).astype(np.float32), "wb"),
        numpy_helper.from_array(np.zeros(4, np.float32), "bb"),
        numpy_helper.from_array((rng.standard_normal((2, 8, 1, 1)) * 1.5).astype(np.float32), "ws"),
        numpy_helper.from_array(np.full(2, -1.5, np.float32), "bs"),
        numpy_helper.from_array(np.array([330.0], np.float32), "k330"),
        numpy_helper.from_array(np.array([0, 4, -1], np.int64), "shape_b"),
        numpy_helper.from_array(np.array([0, 2, -1], np.int64), "shape_s"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wb", "bb"], ["cb"], name="box_conv"),
        helper.make_node("Sigmoid", ["cb"], ["sb"], name="box_sigmoid"),
        helper.make_node("Mul", ["sb", "k330"], ["boxes"], name="box_scale"),
        helper.make_node("Conv", ["r1", "ws", "bs"], ["cs"], name="score_conv"),
        helper.make_node("Sigmoid", ["cs"], ["scores"], name="score_sigmoid"),
        helper.make_node("Reshape", ["boxes", "shape_b"], ["fb"], name="box_flat"),
        helper.make_node("Reshape", ["scores", "shape_s"], ["fs"], name="score_flat"),
        helper.make_node("Concat", ["fb", "fs"], ["output0"], name="head_concat", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "concat_head",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 6, SIZE * SIZE])],
        initializer=inits,
    )
    return _save_checked(graph, path, 17)


def make_faint_map_model(path: Path) -> Path:
    """A probability-map head whose maps sit around 1e-7 (a blank page to a text detector)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(4, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((1, 4, 3, 3)) * 0.3).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([-16.0], np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["maps"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes, "faint_map",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("maps", TensorProto.FLOAT, ["batch", 1, SIZE, SIZE])],
        initializer=inits,
    )
    return _save_checked(graph, path, 17)


def _spec(name: str, output: str) -> dict:
    return {
        "name": name, "version": 1, "label": "0.1.0", "task": "raw",
        "frame": {"kind": "image", "height": SIZE, "width": SIZE, "channels": 3, "color": "rgb"},
        "preprocess": {"color": "rgb", "scale": 1 / 255, "layout": "nchw", "dtype": "float32"},
        "postprocess": {"type": "raw", "outputs": [output]},
        "selftest": {"latency_budget_ms": {"default": 1000.0}},
    }


def _inputs(d: Path, model: Path, spec: dict) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(d / "calib.npz", raw=structured_frames(24, SIZE, 11))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(8, SIZE, 12))
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    # synthetic heads with no package to answer for them: decoders built unproven, on purpose
    return {"model": model, "spec": d / "spec.yaml", "calibration": d / "calib.npz", "golden": d / "golden.npz",
            "allow_unproven_decoder": True}


@pytest.fixture(scope="module")
def detector_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("concat-head")
    return _inputs(d, make_concat_head_detector(d / "det.onnx"), _spec("concat-head", "output0"))


@pytest.fixture(scope="module")
def kept_detector(detector_inputs: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kept") / "bundle"
    return create_bundle(CreateOptions(out=out, keep_low_quality=True, min_agreement=0.0, **detector_inputs))


def test_whole_graph_int8_that_drowns_detector_scores_is_refused_naming_the_channel(
        detector_inputs: dict, tmp_path: Path) -> None:
    with pytest.raises(QualityError) as err:
        create_bundle(CreateOptions(out=tmp_path / "b", min_agreement=0.0, **detector_inputs))
    text = str(err.value)
    assert "variant int8" in text and "fidelity: worst channel SNR dB = " in text
    assert "under bound 15" in text and ("channel 4" in text or "channel 5" in text)
    assert "at stage build golden" in text
    assert not (tmp_path / "b").exists()


def test_keep_low_quality_marks_the_variant_and_never_lowers_a_floor(kept_detector: Path) -> None:
    b = load_bundle(kept_detector)
    int8, fp32 = b.manifest.variant("int8"), b.manifest.variant("fp32")
    assert int8.below_floor and "worst channel SNR dB" in int8.below_floor and fp32.below_floor is None
    assert b.manifest.selftest.fidelity == {} and b.manifest.selftest.parity == {}  # no gate written from a measurement
    assert int8.recorded["provider"] == "CPUExecutionProvider" and int8.recorded["onnxruntime"]
    with np.load(kept_detector / "golden" / "sample_000.npz") as z:
        assert {"variant.fp32.output0", "variant.int8.output0"} <= set(z.files)


def test_marked_variant_is_never_selected_unless_pinned_and_a_pinned_one_is_loud(
        kept_detector: Path, tmp_path: Path) -> None:
    report = run_selftest(load_bundle(kept_detector), tmp_path / "a", FAST)
    assert [r.candidate.variant for r in report.results] == ["fp32"]
    assert report.selected.candidate.variant == "fp32"
    assert any("int8" in n and "below a fidelity floor" in n for n in report.notes)

    pinned = run_selftest(load_bundle(kept_detector), tmp_path / "b",
                          replace(FAST, policy=SelectionPolicy(variant="int8")))
    assert pinned.selected is not None and pinned.selected.candidate.variant == "int8"
    doc = pinned.to_dict()
    assert doc["pinned_below_floor"] and "worst channel SNR dB" in doc["pinned_below_floor"]
    assert any("pinned by the config" in w for w in doc["warnings"])
    assert doc["candidates"][0]["reproduction"]["passed"] and not doc["candidates"][0]["fidelity"]["passed"]


def test_whole_graph_int8_declared_raw_is_rejected_on_the_device_by_fidelity_not_passed_on_cosine(
        kept_detector: Path, tmp_path: Path) -> None:
    # a device given a bundle whose int8 lost its mark (an older builder): the self-test itself refuses it
    root = tmp_path / "unmarked"
    shutil.copytree(kept_detector, root)
    rewrite_manifest(root, lambda d: d["variants"][1].pop("below_floor"))
    report = run_selftest(load_bundle(root), tmp_path / "s", FAST)
    by = {r.candidate.variant: r for r in report.results}
    assert by["fp32"].passed and report.selected.candidate.variant == "fp32"
    f = next(f for f in by["int8"].findings if f.check == "fidelity")
    assert f.metric == "worst channel SNR dB" and f.value < 15 and f.sample is not None and f.stage == "model"
    assert by["int8"].evidence.fidelity.cosine > 0.99  # what the old gate looked at


@pytest.fixture(scope="module")
def faint_map_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("faint")
    inputs = _inputs(d, make_faint_map_model(d / "map.onnx"), _spec("faint-map", "maps"))
    return create_bundle(CreateOptions(out=d / "bundle", int8=False, **inputs))


def test_map_output_near_1e7_passes_fp32_on_the_machine_that_built_it_every_cold_run(
        faint_map_bundle: Path, tmp_path: Path) -> None:
    b = load_bundle(faint_map_bundle)
    assert float(np.max(b.golden()[0].outputs["maps"])) < 1e-5
    for i in range(5):
        report = run_selftest(b, tmp_path / str(i), FAST)
        assert report.selected is not None, report.reason


def test_map_output_near_1e7_passes_fp32_against_the_source_when_no_outputs_were_recorded(
        faint_map_bundle: Path, tmp_path: Path) -> None:
    # A bundle from before recorded variant outputs: reproduction falls back to the references
    # (made without graph optimisation, so optimisation noise is in the comparison).
    root = tmp_path / "legacy"
    shutil.copytree(faint_map_bundle, root)
    for p in (root / "golden").glob("*.npz"):
        with np.load(p) as z:
            arrays = {k: z[k] for k in z.files if not k.startswith("variant.")}
        np.savez_compressed(p, **arrays)
    rewrite_manifest(root)
    report = run_selftest(load_bundle(root), tmp_path / "s", FAST)
    assert report.selected is not None, report.reason
    assert report.selected.evidence.reproduction.against == "source"
    assert any("reproduction reference=source" in n for n in report.notes)


def test_nan_output_is_named_and_selftest_json_parses_with_a_strict_parser(tiny_bundle: Path, tmp_path: Path) -> None:
    scale_initializer(tiny_bundle / "model_fp32.onnx", "fc_w", float("nan"))
    rewrite_manifest(tiny_bundle)
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "warning", "selftest", "--bundle",
                          str(tiny_bundle), "--state-dir", str(tmp_path), "--no-cache", "--json",
                          "--variant", "fp32", "--latency-runs", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")
    doc = json.loads(out.stdout, parse_constant=refuse)
    json.loads((tmp_path / "selftest" / "report.json").read_text(), parse_constant=refuse)
    cand = doc["candidates"][0]
    assert any(r.startswith("output: non-finite output logits") and "NaN" in r for r in cand["reasons"]), cand["reasons"]
    assert "non-finite output logits" in doc["reason"]


def test_floors_are_the_authors_and_a_build_keeps_them_as_written(detector_inputs: dict, tmp_path: Path) -> None:
    spec = yaml.safe_load(Path(detector_inputs["spec"]).read_text())
    spec["selftest"]["fidelity"] = {"min_channel_snr_db": -10.0}  # this author accepts a broken int8
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    b = load_bundle(create_bundle(CreateOptions(out=tmp_path / "lenient", min_agreement=0.0,
                                                **{**detector_inputs, "spec": tmp_path / "spec.yaml"})))
    assert b.manifest.variant("int8").below_floor is None
    assert b.manifest.selftest.fidelity == {"min_channel_snr_db": -10.0}

    spec["selftest"]["fidelity"] = {"min_channel_snr_db": 80.0}  # stricter than anything int8 measures
    (tmp_path / "strict.yaml").write_text(yaml.safe_dump(spec))
    kept = load_bundle(create_bundle(CreateOptions(out=tmp_path / "strict", min_agreement=0.0, keep_low_quality=True,
                                                   **{**detector_inputs, "spec": tmp_path / "strict.yaml"})))
    assert kept.manifest.selftest.fidelity == {"min_channel_snr_db": 80.0}  # kept as written, never lowered
    assert "under bound 80" in kept.manifest.variant("int8").below_floor


def test_selftest_table_shows_both_questions_and_the_task_metric(kept_detector: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle",
                          str(kept_detector), "--state-dir", str(tmp_path), "--no-cache", "--variant", "int8",
                          "--latency-runs", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[1:3]
    assert "reproduction" in header and "fidelity" in header
    assert "ok vs variant" in row and "LOW SNR " in row and "PASS (warnings)" in row
    assert "warning: fidelity: worst channel SNR dB" in out.stdout
    assert "edge-agent: warning: " in out.stderr and "pinned by the config" in out.stderr
    inspect = subprocess.run([sys.executable, "-m", "agent", "bundle", "inspect", str(kept_detector)],
                             capture_output=True, text=True, timeout=60)
    assert "BELOW FLOOR int8: variant int8: fidelity: worst channel SNR dB" in inspect.stdout


def test_fp32_reproduces_under_any_graph_optimisation_level_on_the_machine_that_built_it(
        tiny_bundle: Path, tmp_path: Path) -> None:
    # Recorded with optimisation "all"; a device configured otherwise sees reordered float sums only.
    from agent.proof.terms import SessionSettings

    for level in ("disable", "basic", "extended", "all"):
        opts = replace(FAST, settings=SessionSettings(graph_optimization=level), policy=SelectionPolicy(variant="fp32"))
        report = run_selftest(load_bundle(tiny_bundle), tmp_path / level, opts)
        assert report.selected is not None, (level, report.reason)
        assert report.selected.evidence.reproduction.against == "variant"
