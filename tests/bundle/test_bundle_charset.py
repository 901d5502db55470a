"""A text result's charset travels in the bundle: `bundle create --charset FILE` copies it (hashed, signed)
to the name `postprocess.result.charset` gives; the `post.ctc` recipe's graph then serves the text, a
charset line holding a space serving a space."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
import yaml

from stage_graphs import constant_head_model

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.graphs import build_graph
from agent.bundle.load import load_bundle
from agent.errors import BundleError
from agent.proof.selftest import evaluate
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.vocabulary.preprocess import read_image_file


CHARSET = ["blank", "a", " ", "b"]  # id 0 the blank, id 2 the space
STEPS = [1, 1, 0, 2, 3, 3, 0, 0, 1]  # CTC: a a _ ' ' b b _ _ a -> "a ba"


def _text_bundle(d: Path, charset: bool = True) -> Path:
    head = np.full((1, len(STEPS), len(CHARSET)), 0.01, np.float32)
    head[0, np.arange(len(STEPS)), STEPS] = 0.97
    model = constant_head_model(d / "m.onnx", head, input_name="x", size=32, output="softmax")
    post = d / "post.onnx"
    onnx.save(build_graph("post.ctc", {"input": "softmax"}), str(post))
    golden = d / "golden"
    golden.mkdir()
    for i in range(2):
        cv2.imwrite(str(golden / f"{i}.png"), np.full((40, 40, 3), 60 * i, np.uint8))
    answer = {"type": "text", "text": "a ba", "confidence": 0.97, "chars": []}
    (golden / "answers.json").write_text(json.dumps({"kind": "text", "package": "test", "produced_by": "test",
                                                      "results": [answer, answer]}))
    (d / "charset.txt").write_text("\n".join(CHARSET) + "\n")
    spec = {"name": "ctc", "version": 1, "task": "text",
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "bgr"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": {"graph": "post.onnx", "uses": ["softmax"],
                            "result": {"kind": "text", "tokens": "tokens", "token_scores": "token_scores",
                                       "charset": "charset.txt", "blank": 0}}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    return create_bundle(CreateOptions(model=model, spec=d / "spec.yaml", calibration=golden, golden=golden,
                                       out=d / "bundle", int8=False, post_graph=post,
                                       charset=d / "charset.txt" if charset else None))


def test_charset_is_copied_hashed_and_serves_the_text_with_its_space(tmp_path: Path) -> None:
    b = load_bundle(_text_bundle(tmp_path))
    m = b.manifest
    assert m.postprocess.result is not None and m.postprocess.result.charset == "charset.txt"
    assert "charset.txt" in m.files and (b.root / "charset.txt").read_text().split("\n")[2] == " "
    engine = build_engine(b, Candidate(CPU, "fp32", "fp32"), SessionSettings())
    frame = read_image_file(str(tmp_path / "golden" / "0.png"), m.frame)
    tensor, geometry = engine.preprocessor.with_geometry(frame)
    result = engine.decode({k: v[0] for k, v in engine.run(tensor).items()}, geometry, 65536)
    assert result["type"] == "text" and result["text"] == "a ba", result
    assert evaluate(b, Candidate(CPU, "fp32", "fp32"), SessionSettings(), b.golden(), latency=False).passed


def test_a_spec_naming_a_charset_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"key postprocess.result.charset: .*--charset"):
        _text_bundle(tmp_path, charset=False)
