"""Issue 42: a time-major output (`[T, B, C]`, a CTC recogniser exported from a PyTorch RNN) declared with
`outputs.<name>.batch_axis: 1` in the spec is built, proven and served with no edit of the model: every place that
takes one frame's outputs out of a batch slices on axis 1, and the post graph gets the slice batch-first.
Before, the agent took axis 0 as the batch and handed the post graph one time step."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.graphs import write_graph
from agent.bundle.load import load_bundle
from agent.config import PipelineConfig, SourceConfig
from agent.errors import BundleError
from agent.proof.selftest import evaluate
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.serving.sources import is_lossless, open_source
from agent.testing import ListSink, structured_frames
from pipelines import run_to_end

FP32 = Candidate(CPU, "fp32", "fp32")
STEPS, CLASSES = 8, 5
CHARSET = ["~", "a", "b", "c", "d"]  # line 0: the blank


def time_major_model(path: Path) -> Path:
    """images [B, 3, 32, 32] -> logits [T=8, B, 5]: column means, 4 per step, a fixed projection, time-major."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 40, (4, CLASSES)).astype(np.float32)
    b = rng.normal(0, 1, (CLASSES,)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["cols"], axes=[1, 2], keepdims=0),  # [B, 32]
        helper.make_node("Constant", [], ["shape"], value=helper.make_tensor("s", TensorProto.INT64, [3], [0, STEPS, 4])),
        helper.make_node("Reshape", ["cols", "shape"], ["steps"]),  # [B, 8, 4]
        helper.make_node("Constant", [], ["w"], value=helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())),
        helper.make_node("Constant", [], ["b"], value=helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel())),
        helper.make_node("Constant", [], ["mid"], value=helper.make_tensor("m", TensorProto.FLOAT, [], [0.45])),
        helper.make_node("Sub", ["steps", "mid"], ["centred"]),  # levels around mid-grey: steps differ
        helper.make_node("MatMul", ["centred", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["bm"]),  # [B, 8, 5]
        helper.make_node("Transpose", ["bm"], ["logits"], perm=[1, 0, 2]),  # [8, B, 5]
    ]
    graph = helper.make_graph(nodes, "time_major",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [STEPS, "batch", CLASSES])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def package_text(logits: np.ndarray) -> str:
    """What a time-major package does (ddddocr's `output[:, 0, :]`): argmax per step, repeats and blanks dropped."""
    ids = np.argmax(logits[:, 0, :], axis=1)
    out, prev = [], None
    for i in ids.tolist():
        if i != prev and i != 0:
            out.append(CHARSET[i])
        prev = i
    return "".join(out)


def _frames(d: Path, n: int, seed: int) -> list[np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    frames = list(structured_frames(n, 40, seed))
    for i, f in enumerate(frames):
        cv2.imwrite(str(d / f"{i:03d}.png"), cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    return frames


def _answers(d: Path, model: Path, frames: list[np.ndarray]) -> None:
    """The package's own texts: the model run by onnxruntime on the frames, decoded time-major."""
    import onnxruntime as ort

    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    texts = []
    for f in frames:
        x = cv2.resize(f, (32, 32), interpolation=cv2.INTER_LINEAR).astype(np.float32) / 255
        texts.append(package_text(s.run(None, {"images": x.transpose(2, 0, 1)[None]})[0]))
    (d / "answers.json").write_text(json.dumps({"kind": "text", "package": "a time-major test recogniser",
                                                "produced_by": "tests/vocabulary/test_batch_axis.py",
                                                "results": [{"type": "text", "text": t} for t in texts]}))


def _build(d: Path, declare: bool) -> tuple[Path, Path]:
    model = time_major_model(d / "m.onnx")
    golden = d / "golden"
    _answers(golden, model, _frames(golden, 6, 1))
    spec = {"name": "time-major", "version": 1, "task": "text",
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": {"graph": "post.onnx", "uses": ["logits"],
                            "result": {"kind": "text", "tokens": "tokens", "token_scores": "token_scores",
                                       "charset": "charset.txt", "blank": 0}}}
    if declare:
        spec["outputs"] = {"logits": {"batch_axis": 1}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    (d / "charset.txt").write_text("\n".join(CHARSET) + "\n")
    post = write_graph("post.ctc", d / "post.onnx", {"input": "logits"})
    out = create_bundle(CreateOptions(model=model, spec=d / "spec.yaml", calibration=golden, golden=golden,
                                      out=d / "bundle", int8=False, post_graph=post, charset=d / "charset.txt"))
    return out, model


def test_time_major_output_declared_batch_axis_1_is_built_proven_and_served_in_batches_equal_to_the_package(
        tmp_path: Path) -> None:
    root, model = _build(tmp_path, declare=True)
    b = load_bundle(root)
    assert b.manifest.batch_axes == {"logits": 1}
    from agent.proof.inspect import render_text, summarize

    assert "logits float32 [8, 'batch', 5] (batch axis 1)" in render_text(summarize(b))
    assert yaml.safe_load((root / "bundle.yaml").read_text())["outputs"][0]["batch_axis"] == 1
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert r.passed and r.evidence.fidelity.against == "package answers", r.reasons
    # served in batches of up to 4 frames: [8, 4, 5] sliced on axis 1 per frame
    engine = build_engine(b, FP32, SessionSettings())
    assert engine.dynamic_batch
    frames = _frames(tmp_path / "held", 12, 7)
    _answers(tmp_path / "held", model, frames)
    want = [a["text"] for a in json.loads((tmp_path / "held" / "answers.json").read_text())["results"]]
    cfg = SourceConfig(type="folder", path=tmp_path / "held")
    source = open_source(cfg, b.manifest.frame)
    sink = ListSink()
    p = run_to_end(source, engine, sink, PipelineConfig(max_batch=4, batch_timeout_ms=200), is_lossless(cfg, source))
    assert p.metrics.result_errors == 0 and len(sink.results) == len(want)
    assert max(x["batch"] for x in sink.results) > 1, "no frames were batched: the batch axis was not exercised"
    assert [x["result"]["text"] for x in sink.results] == want
    assert len(set(want)) >= 6  # the frames read as different texts: a real check of each slice


def test_time_major_output_without_the_declaration_is_refused_naming_the_batch_axis_key(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"outputs\.logits\.batch_axis: 1"):
        _build(tmp_path, declare=False)


def test_a_declared_batch_axis_the_output_does_not_have_is_refused_naming_the_key(tmp_path: Path) -> None:
    model = time_major_model(tmp_path / "m.onnx")
    golden = tmp_path / "golden"
    _frames(golden, 2, 1)
    spec = {"name": "time-major", "version": 1, "task": "raw",
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": {"type": "raw"}, "outputs": {"logits": {"batch_axis": 3}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(BundleError, match=r"key outputs\.logits\.batch_axis: 3 is not an axis of output 'logits'"):
        create_bundle(CreateOptions(model=model, spec=tmp_path / "spec.yaml", calibration=golden, golden=golden,
                                    out=tmp_path / "bundle", int8=False))


def test_a_bundle_whose_manifest_lacks_the_batch_axis_fails_its_self_test_naming_the_key(tmp_path: Path) -> None:
    """A bundle made before the declaration (or edited): the self-test names outputs[].batch_axis instead of
    judging time step 0."""
    from agent.testing import rewrite_manifest

    root, _ = _build(tmp_path, declare=True)
    doc = yaml.safe_load((root / "bundle.yaml").read_text())
    del doc["outputs"][0]["batch_axis"]
    (root / "bundle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    rewrite_manifest(root)
    b = load_bundle(root)
    r = evaluate(b, FP32, SessionSettings(), b.golden(), latency=False)
    assert not r.passed
    assert "declare `outputs.logits.batch_axis: 1`" in " ".join(r.reasons), r.reasons


def test_the_audit_counts_frames_of_a_time_major_output_not_its_time_steps(tmp_path: Path) -> None:
    """The live audit took axis 0 of every output as the batch: a time-major frame counted as 8 samples (one per
    time step), so its window of 2 filled on the first frame. On the batch axis: one sample per frame."""
    from auditing import audited

    root, _ = _build(tmp_path, declare=True)
    engine = build_engine(load_bundle(root), FP32, SessionSettings())
    auditor = audited(engine, 40, 3)  # three steps: a canary and one served frame each; a window of 2 frames
    c = auditor.counters
    assert c["live_samples"] == 3 and c["live_windows"] == 1 and c["live_drift"] == 0, c
    assert c.get("canary_failures", 0) == 0, c
