"""`bundle create` for sensor models (issue 22): already-quantised graphs kept as int8, the spec checked
before anything slow, and single-output binary classifiers judged by their decisions, not argmax of one value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.conftest import TINY_SENSOR_SPEC

ROOT = Path(__file__).resolve().parents[2]


def _windows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(64, dtype=np.float32)
    f = rng.uniform(0.05, 0.4, (n, 1, 3))
    return (np.sin(t[None, :, None] * f) + rng.normal(0, 0.2, (n, 64, 3))).astype(np.float32)


def _sets(d: Path, spec: dict[str, Any]) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    np.savez(d / "calib.npz", raw=_windows(32, 1))
    np.savez(d / "golden.npz", raw=_windows(6, 2))
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return {"calibration": d / "calib.npz", "golden": d / "golden.npz", "spec": d / "spec.yaml"}


def _create(model: Path, sets: dict[str, Path], out: Path, **kw: Any) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    return create_bundle(CreateOptions(model=model, spec=sets["spec"], calibration=sets["calibration"],
                                       golden=sets["golden"], out=out, **kw))


@pytest.fixture(scope="module")
def qdq_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's already-quantised model: the QDQ INT8 that ORT's quantizer made of a float sensor model."""
    from agent.testing import make_tiny_sensor_model

    d = tmp_path_factory.mktemp("qdq")
    b = _create(make_tiny_sensor_model(d / "float.onnx"), _sets(d, TINY_SENSOR_SPEC), d / "float-bundle",
                min_agreement=0.5, keep_low_quality=True)
    return b / "model_int8.onnx"


def test_an_already_qdq_model_is_kept_as_int8_without_quantising_and_the_selftest_judges_it(
        qdq_model: Path, tmp_path: Path) -> None:
    sets = _sets(tmp_path, TINY_SENSOR_SPEC)
    t0 = time.perf_counter()
    bundle = _create(qdq_model, sets, tmp_path / "bundle")  # int8 requested (the default): not quantised again
    seconds = time.perf_counter() - t0
    m = yaml.safe_load((bundle / "bundle.yaml").read_text())
    assert [(v["name"], v["precision"]) for v in m["variants"]] == [("int8", "int8")]
    q = m["variants"][0]["quantization"]
    assert q["format"] == "prequantized" and q["ops"]["QuantizeLinear"] > 0 and q["ops"]["DequantizeLinear"] > 0
    print(f"\nprequantized build in {seconds:.1f} s: {q}")
    r = subprocess.run([sys.executable, "-m", "agent", "selftest", "--bundle", str(bundle), "--state-dir",
                        str(tmp_path / "state"), "--json", "--no-cache"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["selected"]["variant"] == "int8", doc.get("selected")


def test_dynamically_quantised_integer_ops_are_detected_as_already_quantised(tmp_path: Path) -> None:
    from onnxruntime.quantization import quantize_dynamic

    from agent.bundle.quantise import prequantized
    from agent.testing import make_tiny_sensor_model

    float_model = make_tiny_sensor_model(tmp_path / "f.onnx")
    assert prequantized(float_model) is None
    quantize_dynamic(str(float_model), str(tmp_path / "dyn.onnx"))
    found = prequantized(tmp_path / "dyn.onnx")
    assert found is not None
    assert {"DynamicQuantizeLinear"} <= set(found["ops"]) and ({"ConvInteger", "MatMulInteger"} & set(found["ops"]))


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s["postprocess"].update(top_kk=1), "key postprocess: Additional properties are not allowed ('top_kk'"),
    (lambda s: s.update(label="v1"), "key label: 'v1' does not match"),
    (lambda s: s["frame"].update(window_s=1.0), "window_s: a time in seconds needs frame.sample_rate"),
    (lambda s: s["postprocess"].update(output="logits"), "postprocess.output: 'logits' is not a declared output"),
])
def test_a_bad_spec_is_refused_before_any_quantisation_starts(tmp_path: Path, mutate: Any, message: str) -> None:
    from agent.errors import BundleError
    from agent.testing import make_tiny_sensor_model

    spec = json.loads(json.dumps(TINY_SENSOR_SPEC))
    mutate(spec)
    sets = _sets(tmp_path, spec)
    np.savez(sets["calibration"], raw=_windows(2000, 3))  # quantising this would take far longer than the bound
    model = make_tiny_sensor_model(tmp_path / "s.onnx")
    t0 = time.perf_counter()
    with pytest.raises(BundleError) as e:
        _create(model, sets, tmp_path / "bundle", calibration_limit=2000)
    seconds = time.perf_counter() - t0
    assert message in str(e.value), str(e.value)
    assert seconds < 2.0, f"refused after {seconds:.1f} s"
    assert not (tmp_path / "bundle").exists()


def test_held_out_top1_of_a_single_output_binary_classifier_is_its_decision(tmp_path: Path) -> None:
    """One logit per sample: classes 0 and 1 by its sigmoid (the decoder's rule); argmax over one value said
    class 0 for every sample (0.625 on a set where agreement is 1.0)."""
    from agent.bundle.build_runs import _top1
    from agent.vocabulary.manifest import PostprocessSpec

    post = PostprocessSpec(type="classification", output="logit")
    outs = [{"logit": np.array([[v]], np.float32)} for v in (-2.0, 3.0, 0.5, -0.1)]
    assert _top1(outs, "logit", post).tolist() == [0, 1, 1, 0]
