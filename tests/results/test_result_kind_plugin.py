"""A result kind is one module: a throwaway kind (tests/throwaway_kind.py), registered from this file and
nowhere else, is taken by the manifest's checks, the bundle schema (task, result block, floors), `bundle
create` judging the package's answers, the self-test and the engine serving the demo through a post graph.
Without its registration the same manifest is refused naming the key (issue 46 point 3)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

import throwaway_kind
from agent.errors import BundleError
from agent.vocabulary.manifest import manifest_schema, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
BASE = yaml.safe_load((DEMO / "bundle.yaml").read_text())


@pytest.fixture
def peak() -> Iterator[None]:
    from agent.results import add_kind, remove_kind

    add_kind(throwaway_kind)  # the one registration: nothing else names the kind
    try:
        yield
    finally:
        remove_kind("peak")


def _manifest(**result: Any) -> str:
    d = copy.deepcopy(BASE)
    d["task"] = "peak"
    d["preprocess"] = {"graph": "pre.onnx"}
    d["postprocess"] = {"graph": "post.onnx", "result": {"kind": "peak", "values": "probabilities", **result}}
    d["files"] = {**d["files"], "pre.onnx": "0" * 64, "post.onnx": "0" * 64}
    return yaml.safe_dump(d)


def test_a_throwaway_kind_is_a_task_a_result_block_and_floors_in_the_schema(peak: None) -> None:
    schema = manifest_schema()
    assert "peak" in schema["properties"]["task"]["enum"]
    result = schema["$defs"]["result"]["properties"]
    assert "peak" in result["kind"]["enum"]
    assert result["values"]["description"] == "peak: [C] values whose largest is served."
    assert result["digits"]["maximum"] == 9
    floors = schema["properties"]["selftest"]["properties"]["fidelity"]["properties"]
    assert floors["min_peak_agreement"]["description"].startswith("peak: share of samples")
    m = parse_manifest(_manifest(digits=3))
    assert m.postprocess.result is not None and m.postprocess.result.as_mapping() == {
        "kind": "peak", "values": "probabilities", "digits": 3}


@pytest.mark.parametrize(("result", "message"), [
    ({"top_k": 3}, "key postprocess.result.top_k: applies to classes, not peak"),
    ({"digits": 12}, "key postprocess.result.digits: 12 is greater than the maximum of 9"),
    ({"scores": "s"}, "key postprocess.result.scores: not a field of kind peak (fields: ['values'])"),
])
def test_a_throwaway_kinds_wrong_keys_are_refused_naming_the_key(peak: None, result: dict, message: str) -> None:
    with pytest.raises(BundleError, match=re.escape(message)):
        parse_manifest(_manifest(**result))


def test_without_its_registration_the_kind_is_refused_and_the_schema_never_knew_it() -> None:
    with pytest.raises(BundleError, match=r"key postprocess.result.kind: 'peak' is not one of"):
        parse_manifest(_manifest())
    assert "peak" not in manifest_schema()["properties"]["task"]["enum"]
    assert "min_peak_agreement" not in (ROOT / "docs" / "reference" / "bundle.md").read_text()


def test_a_bundle_of_a_throwaway_kind_is_built_proven_and_served_against_the_packages_answers(
        peak: None, tmp_path: Path) -> None:
    """The demo classifier through a softmax post graph, served as `peak`: answers = the declarative demo's
    top-1 (the package run end to end); `bundle create` judges them, the self-test proves the bundle, and
    the engine serves every demo frame's peak at the package's class."""
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.bundle.load import load_bundle
    from agent.proof.selftest import evaluate
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.vocabulary.preprocess import read_image_file
    from agentproc import DEMO_FRAMES
    from stage_graphs import demo_answers, softmax_post, stretch_pre

    fp32 = Candidate(CPU, "fp32", "fp32")
    frames = sorted(DEMO_FRAMES.glob("*.png"))
    golden = demo_answers(frames[:8], tmp_path / "golden")
    classes = json.loads((golden / "answers.json").read_text())["results"]
    (golden / "answers.json").write_text(json.dumps({
        "kind": "peak", "package": "digits-classifier declarative", "produced_by": "tests/results/test_result_kind_plugin.py",
        "results": [{"type": "peak", "index": r["top"][0]["class_id"], "value": r["top"][0]["score"]}
                    for r in classes]}))
    m = load_bundle(DEMO).manifest
    spec = {"name": "digits-peak", "version": 1, "label": "1.0.0", "task": "peak",
            "frame": {"kind": "image", "height": 160, "width": 160, "channels": 3, "color": "rgb"},
            "postprocess": {"result": {"kind": "peak", "values": "probabilities", "digits": 3}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = create_bundle(CreateOptions(
        model=DEMO / "model_fp32.onnx", spec=tmp_path / "spec.yaml", calibration=golden, golden=golden,
        out=tmp_path / "bundle", int8=False,
        pre_graph=stretch_pre(tmp_path / "pre.onnx", "input", 128, 128, m.preprocess.scale, m.preprocess.mean,
                              m.preprocess.std),
        post_graph=softmax_post(tmp_path / "post.onnx", "logits", 10)))
    b = load_bundle(out)
    r = evaluate(b, fp32, SessionSettings(), b.golden(), latency=False)
    assert r.passed, r.reasons
    assert r.evidence.fidelity.against == "package answers"
    assert r.evidence.fidelity.agreement.metrics["peak_agreement"] == 1.0
    declarative, served = build_engine(load_bundle(DEMO), fp32, SessionSettings()), build_engine(b, fp32, SessionSettings())
    for p in frames:
        got = []
        for engine in (declarative, served):
            raw = read_image_file(str(p), engine.bundle.manifest.frame)
            tensor, geometry = engine.preprocessor.with_geometry(raw)
            got.append(engine.decode({k: v[0] for k, v in engine.run(tensor).items()}, geometry, 65536))
        want, peak_result = got
        assert peak_result["type"] == "peak" and peak_result["index"] == want["top"][0]["class_id"], (p.name, got)
        assert abs(peak_result["value"] - want["top"][0]["score"]) <= 0.02 and np.isfinite(peak_result["value"])
