"""Issue 42: a package that re-encodes every frame as JPEG before inference. `preprocess.jpeg_roundtrip: {quality:
Q}` states the step (applied with OpenCV to each raw frame before the preprocessing, in serving, the self-test and
`bundle create`); without it the build's drift refusal names that key, where it used to blame the resize."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.load import load_bundle
from agent.errors import BundleError
from agent.proof.selftest import evaluate
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.testing import make_tiny_classifier, structured_frames

SIZE, QUALITY = 32, 80
FP32 = Candidate(CPU, "fp32", "fp32")


def package_input(raw_rgb: np.ndarray) -> np.ndarray:
    """What the package feeds its model: the RGB frame through a JPEG buffer (OpenCV, quality 80), then resized
    to 32x32 and scaled, NCHW."""
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(raw_rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, QUALITY])
    assert ok
    rgb = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    x = cv2.resize(rgb, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR).astype(np.float32) / 255
    return x.transpose(2, 0, 1)[None]


def _inputs(d: Path, preprocess_extra: dict) -> CreateOptions:
    d.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("calib", 8, 1), ("golden", 4, 2)):
        raw = structured_frames(n, 64, seed)
        np.savez_compressed(d / f"{name}.npz", raw=raw, input=np.concatenate([package_input(r) for r in raw]))
    spec = {"name": "jpeg", "version": 1, "task": "classification",
            "frame": {"kind": "image", "height": 64, "width": 64, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": SIZE, "height": SIZE, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32", **preprocess_extra},
            "postprocess": {"type": "classification", "output": "logits", "top_k": 1}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return CreateOptions(model=make_tiny_classifier(d / "m.onnx", size=SIZE), spec=d / "spec.yaml",
                         calibration=d / "calib.npz", golden=d / "golden.npz", out=d / "bundle", int8=False)


def test_without_the_step_the_drift_refusal_names_the_jpeg_roundtrip_key_and_quality(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"The key that explains it: preprocess\.jpeg_roundtrip: \{quality: 80\} "
                                          r"\(with it the max abs is [0-9.e-]+, within 0.001\)"):
        create_bundle(_inputs(tmp_path, {}))


def test_the_declared_step_reproduces_the_package_tensors_and_serves_them(tmp_path: Path) -> None:
    root = create_bundle(_inputs(tmp_path, {"jpeg_roundtrip": {"quality": QUALITY}}))
    b = load_bundle(root)
    assert b.manifest.preprocess.jpeg_roundtrip is not None and b.manifest.preprocess.jpeg_roundtrip.quality == QUALITY
    assert yaml.safe_load((root / "bundle.yaml").read_text())["preprocess"]["jpeg_roundtrip"] == {"quality": QUALITY}
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert r.passed, r.reasons
    engine = build_engine(b, FP32, SessionSettings())
    frame = structured_frames(1, 64, 9)[0]
    served = engine.preprocessor(frame)
    # the same levels: the agent folds / 255 into one multiply, last-bit float differences only
    assert np.max(np.abs(served - package_input(frame))) < 1e-6
    plain = cv2.resize(frame, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR).astype(np.float32) / 255
    assert np.max(np.abs(served - plain.transpose(2, 0, 1)[None])) > 4 / 255  # the JPEG loss is really there


def test_a_quality_out_of_range_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"preprocess.jpeg_roundtrip"):
        create_bundle(_inputs(tmp_path, {"jpeg_roundtrip": {"quality": 0}}))


def test_the_step_runs_before_a_pre_graph_too(tmp_path: Path) -> None:
    from agent.bundle.graphs import write_graph

    opts = _inputs(tmp_path, {})
    spec = yaml.safe_load(opts.spec.read_text())
    spec["preprocess"] = {"graph": "pre.onnx", "jpeg_roundtrip": {"quality": QUALITY}}
    opts.spec.write_text(yaml.safe_dump(spec))
    pre = write_graph("pre.stretch", tmp_path / "pre.onnx", {"width": SIZE, "height": SIZE, "resize": "cv2_exact",
                                                             "scale": 1 / 255, "input_name": "input"})
    import dataclasses

    b = load_bundle(create_bundle(dataclasses.replace(opts, pre_graph=pre)))
    engine = build_engine(b, FP32, SessionSettings())
    frame = structured_frames(1, 64, 9)[0]
    assert np.max(np.abs(engine.preprocessor(frame) - package_input(frame))) < 1e-6
