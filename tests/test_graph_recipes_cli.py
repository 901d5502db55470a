"""`edge-agent bundle graph`, run as a user would (a real process, real files), and every recipe's graph
against the stage interface (input and output names, dtypes, a model onnxruntime loads at opset 17 / IR 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import RECIPES, build_graph  # noqa: E402
from agent.bundle.graphs.builder import IR_VERSION, OPSET  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402
from agent.service.cli import main  # noqa: E402

KIND_FIELDS = {"boxes", "scores", "class_ids", "keypoints", "mask", "tokens", "token_scores", "probabilities"}


def edge_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=120)


def test_bundle_graph_writes_a_letterbox_a_session_runs(tmp_path: Path) -> None:
    out = tmp_path / "pre.onnx"
    rc = main(["--log-level", "error", "bundle", "graph", "pre.letterbox", "--out", str(out), "--input-name", "images",
               "--param", "width=320", "--param", "height=320", "--param", "rounding=floor",
               "--param", "anchor=top_left"])
    assert rc == 0
    sess = ort.InferenceSession(str(out), providers=[CPU])
    x, geometry = sess.run(["images", "geometry"], {"frame": np.zeros((480, 640, 3), np.uint8)})
    assert x.shape == (1, 3, 320, 320)
    np.testing.assert_allclose(geometry, [0.5, 0.5, 0, 0, 0, 0])


def test_bundle_graph_refuses_a_bad_param_naming_recipe_and_key(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "p.onnx")
    assert main(["--log-level", "error", "bundle", "graph", "post.yolox", "--out", out, "--param", "strides=8,x"]) == 2
    assert "recipe post.yolox: --param strides: expected integers separated by commas, found '8,x'" in capsys.readouterr().err
    assert not (tmp_path / "p.onnx").exists()
    assert main(["--log-level", "error", "bundle", "graph", "post.yolo", "--out", out]) == 2
    assert "no recipe 'post.yolo' (recipes: " in capsys.readouterr().err
    assert main(["--log-level", "error", "bundle", "graph", "pre.native", "--out", out, "--param", "multiple"]) == 2
    assert "--param 'multiple': expected KEY=VALUE" in capsys.readouterr().err


def test_bundle_graph_list_shows_every_recipe_and_its_params() -> None:
    r = edge_agent("bundle", "graph", "--list")
    assert r.returncode == 0, r.stderr
    for name, recipe in RECIPES.items():
        assert f"{name}: " in r.stdout
        for key in recipe.params:
            assert f"  {key}=" in r.stdout


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_follows_the_stage_interface(name: str) -> None:
    model = build_graph(name)
    assert model.ir_version == IR_VERSION
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    onnx.checker.check_model(model, full_check=True)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if name.startswith("pre."):
        assert inputs == ["frame"] and outputs == ["images", "geometry"]
        frame = model.graph.input[0].type.tensor_type
        assert frame.elem_type == onnx.TensorProto.UINT8
        assert [d.dim_param or d.dim_value for d in frame.shape.dim] == ["frame_height", "frame_width", 3]
    else:
        assert set(outputs) <= KIND_FIELDS and outputs
        assert not {"frame_size", "geometry"} - set(inputs) or not {"boxes", "mask"} & set(outputs)
