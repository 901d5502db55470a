"""A bundle loads only when schema, hashes, contracts and golden samples all hold; each failure names the problem."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.bundle.load import load_bundle
from agent.errors import BundleError, ContractError
from agent.testing import make_tiny_classifier, rewrite_manifest


def test_created_bundle_verifies_with_fp32_and_int8(tiny_bundle: Path) -> None:
    b = load_bundle(tiny_bundle)
    assert [v.name for v in b.manifest.variants] == ["fp32", "int8"]
    assert b.manifest.input.shape == ("batch", 3, 32, 32)
    assert len(b.golden()) == 8
    g = b.golden()[0]
    assert g.raw.shape == (40, 40, 3) and g.raw.dtype == np.uint8
    assert np.allclose(b.preprocessor()(g.raw), g.input)


def test_missing_file_is_named(tiny_bundle: Path) -> None:
    (tiny_bundle / "model_int8.onnx").unlink()
    with pytest.raises(BundleError, match=r"model_int8\.onnx: missing"):
        load_bundle(tiny_bundle)


def test_hash_mismatch_is_named(tiny_bundle: Path) -> None:
    with open(tiny_bundle / "golden" / "sample_000.npz", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match=r"sample_000\.npz: hash mismatch"):
        load_bundle(tiny_bundle)


def test_unlisted_file_is_refused(tiny_bundle: Path) -> None:
    (tiny_bundle / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleError, match=r"not listed .*extra\.bin"):
        load_bundle(tiny_bundle)


def test_symlink_inside_bundle_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    target.write_text("secret")
    os.symlink(target, tiny_bundle / "labels.txt.link")
    with pytest.raises(BundleError, match="plain file"):
        load_bundle(tiny_bundle)


def test_unknown_manifest_key_is_named(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(latency_budget=3))
    with pytest.raises(BundleError, match=r"bundle\.yaml: .*key selftest: .*latency_budget.*unknown key"):
        load_bundle(tiny_bundle)


def test_malformed_yaml_is_named(tiny_bundle: Path) -> None:
    (tiny_bundle / "bundle.yaml").write_text("name: [unclosed\n")
    with pytest.raises(BundleError, match=r"bundle\.yaml: malformed YAML"):
        load_bundle(tiny_bundle)


def test_bad_fidelity_floor_is_named(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(fidelity={"min_top1_agreement": 1.5}))
    with pytest.raises(BundleError, match=r"key selftest\.fidelity\.min_top1_agreement: 1\.5 is greater than the maximum"):
        load_bundle(tiny_bundle)


def test_reproduction_bounds_for_an_unknown_provider_class_are_refused(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(reproduction={"fp32@tpu": {"rtol": 0.1}}))
    with pytest.raises(BundleError, match=r"selftest\.reproduction"):
        load_bundle(tiny_bundle)


def test_unknown_postprocess_type_is_named(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d["postprocess"].update(type="pose"))
    with pytest.raises(BundleError, match=r"key postprocess: unsupported type 'pose'"):
        load_bundle(tiny_bundle)


def test_model_with_other_outputs_breaks_the_contract(tiny_bundle: Path) -> None:
    make_tiny_classifier(tiny_bundle / "model_int8.onnx", classes=5, seed=3)
    rewrite_manifest(tiny_bundle)
    with pytest.raises(ContractError, match=r"model_int8\.onnx: variant 'int8' breaks the declared contract: output 'logits' shape"):
        load_bundle(tiny_bundle)


def test_declared_input_dtype_mismatch_breaks_the_contract(tiny_bundle: Path) -> None:
    rewrite_manifest(tiny_bundle, lambda d: d["input"].update(dtype="uint8"))
    with pytest.raises(ContractError, match="input 'input' dtype: manifest uint8, model float32"):
        load_bundle(tiny_bundle)


def test_corrupt_golden_sample_is_named(tiny_bundle: Path) -> None:
    (tiny_bundle / "golden" / "sample_001.npz").write_bytes(b"not a zip")
    rewrite_manifest(tiny_bundle)
    with pytest.raises(BundleError, match=r"sample_001\.npz: golden sample 1 is not a readable \.npz"):
        load_bundle(tiny_bundle)


def test_manifest_path_escaping_the_bundle_is_refused(tiny_bundle: Path) -> None:
    def escape(d: dict) -> None:
        d["variants"][0]["file"] = "../model.onnx"

    data = yaml.safe_load((tiny_bundle / "bundle.yaml").read_text())
    escape(data)
    data["files"]["../model.onnx"] = "0" * 64
    (tiny_bundle / "bundle.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(BundleError, match=r"'\.\./model\.onnx' is not a plain relative path"):
        load_bundle(tiny_bundle)


def test_not_a_directory_says_how_to_unpack(tmp_path: Path) -> None:
    f = tmp_path / "b.tar.gz"
    f.write_bytes(b"")
    with pytest.raises(BundleError, match="bundle unpack"):
        load_bundle(f)


def test_missing_manifest_is_named(tiny_bundle: Path) -> None:
    (tiny_bundle / "bundle.yaml").unlink()
    with pytest.raises(BundleError, match=r"bundle\.yaml: missing"):
        load_bundle(tiny_bundle)
