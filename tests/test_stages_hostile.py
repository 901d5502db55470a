"""Stage graphs a careless or hostile bundle author could ship: each fault is refused for the one frame it breaks,
as a stage error the serving pipeline counts (PreprocessError, StageOutputError), never an error that stops it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from stage_graphs import native_pre

from agent.errors import PreprocessError, StageOutputError
from agent.proof.stages import GraphPostprocessor, GraphPreprocessor
from agent.spec.manifest import FrameSpec, PostprocessSpec, PreprocessSpec, ResultSpec, TensorSpec
from agent.spec.preprocess import IDENTITY


def _tokens_post(path: Path, length: int) -> Path:
    """x float [1, T] -> tokens int64 [T] (the ids as given: a CTC collapse already done)."""
    nodes = [helper.make_node("Cast", ["x"], ["t"], to=TensorProto.INT64),
             helper.make_node("Squeeze", ["t"], ["tokens"])]
    graph = helper.make_graph(nodes, "tokens_post", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, length])],
                              [helper.make_tensor_value_info("tokens", TensorProto.INT64, [length])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_text_token_beyond_the_charset_at_serving_is_a_stage_error_the_pipeline_counts(tmp_path: Path) -> None:
    spec = PostprocessSpec(graph="post.onnx", result=ResultSpec(kind="text", charset="charset.txt"))
    post = GraphPostprocessor(_tokens_post(tmp_path / "post.onnx", 4), spec, (), ["_", "a", "b"])
    assert post.decode({"x": np.array([1, 2, 0, 1], np.float32)}, IDENTITY, 65536)["text"] == "aba"
    with pytest.raises(StageOutputError, match=r"stage post \(post\.onnx\).*token id 7 is beyond the charset"):
        post.decode({"x": np.array([1, 7, 0, 1], np.float32)}, IDENTITY, 65536)


def test_pre_graph_output_whose_shape_is_not_the_fixed_model_input_is_refused_naming_stage_pre(tmp_path: Path) -> None:
    frame = FrameSpec(kind="image", height=0, width=0, channels=3, min_size=(8, 8), max_size=(64, 64))
    model_input = TensorSpec("images", "float32", (1, 3, 32, 32))
    pre = GraphPreprocessor(native_pre(tmp_path / "pre.onnx", "images"), frame, PreprocessSpec(graph="pre.onnx"),
                            model_input)
    assert pre(np.zeros((32, 32, 3), np.uint8)).shape == (1, 3, 32, 32)
    # a native-resolution graph for a fixed-size model: the frames of another size make a tensor the model cannot
    # take (and frames of two sizes in one batch could not be stacked)
    with pytest.raises(PreprocessError, match=r"stage pre.*\[1, 3, 40, 32\].*\[1, 3, 32, 32\]"):
        pre(np.zeros((40, 32, 3), np.uint8))
