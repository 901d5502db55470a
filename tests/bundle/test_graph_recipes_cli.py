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
    err = capsys.readouterr().err
    assert "recipe post.yolox: --param strides: expected integers separated by commas, found '8,x'" in err
    assert not (tmp_path / "p.onnx").exists()
    assert main(["--log-level", "error", "bundle", "graph", "post.yolo", "--out", out]) == 2
    assert "no recipe 'post.yolo' (recipes: " in capsys.readouterr().err
    assert main(["--log-level", "error", "bundle", "graph", "pre.native", "--out", out, "--param", "multiple"]) == 2
    assert "--param 'multiple': expected KEY=VALUE" in capsys.readouterr().err



@pytest.mark.parametrize(("recipe", "param", "message"), [
    ("post.priors", "steps=0,16,32", "--param steps: expected values >= 1, found 0"),  # wrote a graph of 0-stride priors
    ("post.priors", "keypoints=0", "--param keypoints: expected values >= 1, found 0"),  # an internal InferenceError
    ("post.priors", "width=-640", "--param width: expected values >= 0, found -640"),
    ("post.priors", "min_sizes=16,0;64;128", "--param min_sizes: expected values >= 1, found 0"),
    ("post.yolox", "strides=8,0,32", "--param strides: expected values >= 1, found 0"),
    ("post.ctc", "blank=-1", "--param blank: expected values >= 0, found -1"),
    ("post.saliency", "channel=-5", "--param channel: expected values >= 0, found -5"),
])
def test_bundle_graph_refuses_a_param_out_of_range_naming_recipe_and_key(
        recipe: str, param: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.onnx"
    assert main(["--log-level", "error", "bundle", "graph", recipe, "--out", str(out), "--param", param]) == 2
    assert f"recipe {recipe}: {message}" in capsys.readouterr().err
    assert not out.exists()

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


def test_docs_recipes_md_carries_every_recipes_parameter_table() -> None:
    from agent.bundle.graph_command import markdown_table
    from agent.bundle.graphs.pre_image import COMMON

    doc = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    assert markdown_table("pre.stretch", skip=("width", "height")) in doc  # the common pre parameters
    for name in RECIPES:
        assert f"### `{name}`" in doc, (f"docs/recipes.md has no section for recipe {name}: add `### `{name}`` "
                                         "with its table, markdown_table() in agent/bundle/graph_command.py")
        table = markdown_table(name, skip=tuple(COMMON) if name.startswith("pre.") else ())
        assert table in doc, f"docs/recipes.md: the parameter table of {name} differs from the code:\n{table}"


def test_pre_model_and_post_merge_with_onnx_compose_into_the_same_result() -> None:
    """Internal names are prefixed per recipe, so the stages compose with the model as they are (the stage
    runner may merge them where that measures faster) and the merged graph computes what the three sessions do."""
    from onnx import compose, helper

    pre = build_graph("pre.stretch", {"width": 16, "height": 16, "scale": 1 / 255, "input_name": "x"})
    post = build_graph("post.classes", {"input": "logits"})
    pool = helper.make_node("GlobalAveragePool", ["x"], ["pooled"])
    flat = helper.make_node("Flatten", ["pooled"], ["logits"])
    graph = helper.make_graph([pool, flat], "model", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    merged = compose.merge_models(compose.merge_models(pre, model, io_map=[("x", "x")]), post,
                                  io_map=[("logits", "logits")])
    onnx.checker.check_model(merged)
    frame = np.random.default_rng(0).integers(0, 256, (37, 53, 3)).astype(np.uint8)
    (probs,) = ort.InferenceSession(merged.SerializeToString(), providers=[CPU]).run(["probabilities"], {"frame": frame})
    x = ort.InferenceSession(pre.SerializeToString(), providers=[CPU]).run(["x"], {"frame": frame})[0]
    logits = ort.InferenceSession(model.SerializeToString(), providers=[CPU]).run(None, {"x": x})[0]
    want = ort.InferenceSession(post.SerializeToString(), providers=[CPU]).run(None, {"logits": logits})[0]
    np.testing.assert_allclose(probs, want, rtol=1e-6)
    names = [{n.name for n in m.graph.node} | {i.name for i in m.graph.initializer}
             for m in (build_graph(r) for r in sorted(RECIPES))]
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1:])  # no recipe shares a name


def test_the_recipes_and_the_cli_import_no_onnx_until_a_graph_is_built() -> None:
    """onnx is the build extra: a device without it still starts `edge-agent` (the parser names `bundle graph`)."""
    code = ("import sys\nimport agent.bundle.graphs\nfrom agent.service.cli import build_parser\nbuild_parser()\n"
            "print('onnx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "False"


def test_without_onnx_bundle_graph_says_to_install_the_build_extra(tmp_path: Path) -> None:
    code = ("import sys\nsys.modules['onnx'] = None\nfrom agent.service.cli import main\n"
            f"sys.exit(main(['bundle', 'graph', 'pre.stretch', '--out', {str(tmp_path / 'p.onnx')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode != 0 and "`bundle graph` needs the build tools (onnx)" in r.stderr
    assert "[build]" in r.stderr
