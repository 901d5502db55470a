"""`bundle create` turns a user's ONNX model into a verified FP32 + INT8 bundle, or refuses cleanly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.bundle.create import CreateOptions, create_bundle
from agent.errors import BundleError, QualityError
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.proof.session import open_session
from agent.testing import make_tiny_classifier


def _opts(tiny_inputs: dict[str, Path], out: Path, **kw) -> CreateOptions:
    return CreateOptions(out=out, **{**tiny_inputs, "min_agreement": 0.5, **kw})


def test_created_int8_variant_is_qdq_with_uint8_activations_and_its_golden_samples_verify(tiny_bundle_master: Path, tmp_path: Path) -> None:
    b = load_bundle(tiny_bundle_master)
    int8 = b.manifest.variant("int8")
    assert int8.quantization["format"] == "QDQ"
    assert int8.quantization["activations"] == "uint8" and int8.quantization["weights"] == "int8"
    assert int8.quantization["per_channel"] is True
    # the golden reference is FP32 on CPU; each variant's own outputs agree with it within its thresholds
    report = run_selftest(b, tmp_path, SelftestOptions(latency_runs=10))
    assert all(r.passed for r in report.results if r.status == "tested"), [r.reasons for r in report.results]
    assert {r.candidate.variant for r in report.results} == {"fp32", "int8"}
    assert "heldout_top1_agreement" in int8.quality and int8.quality["size_bytes"] > 0
    assert b.labels() == ["a", "b", "c", "d"]


def test_golden_references_from_the_source_framework_are_kept(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    golden = np.load(tiny_inputs["golden"])["raw"]
    b0 = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "b0", int8=False)))
    sess = open_session(b0.path("model_fp32.onnx"), "CPUExecutionProvider")
    pre = b0.preprocessor()
    refs = np.concatenate([sess.run(pre(f))["logits"] for f in golden]) + 1e-3  # a "framework" a hair off
    src = tmp_path / "golden_src.npz"
    np.savez(src, raw=golden, **{"reference.logits": refs})
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "b1", golden=src, int8=False)))
    assert np.allclose(b.golden()[0].outputs["logits"][0], refs[0])
    assert b.manifest.variant("fp32").quality["golden_max_abs_vs_source"] == pytest.approx(1e-3, rel=0.05)
    assert "source framework" in b.manifest.source["description"]


def test_int8_below_the_quality_bound_is_refused_and_nothing_is_written(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "refused"
    with pytest.raises(QualityError, match=r"int8 heldout_top1_agreement with fp32 = .* under the bound 1\.01"):
        create_bundle(_opts(tiny_inputs, out, min_agreement=1.01))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_int8_below_the_bound_can_be_kept_and_is_marked(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "kept", min_agreement=1.01, keep_low_quality=True)))
    assert "under the bound" in b.manifest.variant("int8").below_floor


def test_heldout_labels_drive_the_top1_bound(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    held = np.load(tiny_inputs["heldout"])["raw"]
    labelled = tmp_path / "held_labels.npz"
    np.savez(labelled, raw=held, label=np.zeros(len(held), np.int64))
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "lab", heldout=labelled, max_top1_drop=100.0)))
    q = b.manifest.variant("int8").quality
    assert "heldout_top1" in q and "top1_drop_points" in q
    with pytest.raises(QualityError, match=r"points under fp32"):
        create_bundle(_opts(tiny_inputs, tmp_path / "lab2", heldout=labelled, max_top1_drop=-1.0))


def test_excluded_op_types_stay_float(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "ex", exclude_op_types=("Gemm",))))
    assert "fc" in b.manifest.variant("int8").quantization["excluded_nodes"]


def test_opset_12_model_is_upgraded_so_per_channel_int8_loads(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    old = make_tiny_classifier(tmp_path / "op12.onnx", opset=12)
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "op12", model=old)))  # load_bundle opens every variant
    assert b.manifest.variant("int8").quantization["per_channel"] is True


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_calibration_methods_are_selectable(tiny_inputs: dict[str, Path], tmp_path: Path, method: str) -> None:
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / method, method=method, keep_low_quality=True)))
    assert b.manifest.variant("int8").quantization["method"] == method


def test_fp16_variant_is_optional(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    b = load_bundle(create_bundle(_opts(tiny_inputs, tmp_path / "f16", fp16=True)))
    assert [v.name for v in b.manifest.variants] == ["fp32", "int8", "fp16"]


def test_invalid_model_file_is_named(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(BundleError, match=r"bad\.onnx: not a valid ONNX model"):
        create_bundle(_opts(tiny_inputs, tmp_path / "x", model=bad))
    assert not (tmp_path / "x").exists()


def test_spec_with_unknown_key_is_named(tiny_inputs: dict[str, Path], tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(tiny_inputs["spec"].read_text() + "colour: rgb\n")
    with pytest.raises(BundleError, match=r"spec\.yaml: key colour: unknown key"):
        create_bundle(_opts(tiny_inputs, tmp_path / "x", spec=spec))
