"""Build-time recipes for pre and post stage graphs (`edge-agent bundle graph RECIPE --out F.onnx`).

Each recipe writes one small ONNX graph that follows the stage interface (docs/recipes.md): a pre graph takes
`frame` uint8 [H, W, 3] of any size and outputs the model's input plus `geometry` float32 [6] (scale_x,
scale_y, pad_x, pad_y, crop_x, crop_y, as agent.vocabulary.preprocess.Geometry); a post graph takes the model's
outputs by name (batch axis kept), `frame_size` int64 [2] (h, w) and `geometry`, and outputs the fields of a
result kind (boxes, scores, class_ids, keypoints, mask, tokens, token_scores, probabilities).

Why onnx.helper (through builder.Graph) and not onnxscript or onnxruntime-extensions' PrePostProcessor:
- onnx is already the `build` extra's dependency; onnxscript would add a second package (and its own
  opset/version pinning) to write graphs that are a few dozen nodes each;
- PrePostProcessor's steps are fixed (one resize rounding, a centred letterbox, box steps for a few model
  layouts; none of the int()-truncating letterbox, YOLOX grids, RetinaFace priors or CTC collapse), it needs
  onnxruntime-extensions to build, and its image decode/encode steps are custom ops that need that native
  library on the device too, where a bundle must run on stock onnxruntime;
- with onnx.helper every node is visible in the recipe, opset 17 / IR 8 is chosen once (builder.OPSET),
  and onnx.checker with full shape inference checks each graph as it is built.
Build-time only: onnx is imported when a graph is built; serving code never imports this package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bundle.graphs import (post_ctc, post_mask, post_picodet, post_priors, post_scores, post_yolox, pre_height,
                                  pre_image)
from agent.bundle.graphs.params import Param, resolve
from agent.errors import UsageError


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    params: Mapping[str, Param]
    builder: Callable[[str, dict[str, Any]], Any]


def _family(module: Any, summaries: Mapping[str, str]) -> dict[str, Recipe]:
    return {name: Recipe(name, summaries[name], module.PARAMS[name], module.build) for name in module.PARAMS}


RECIPES: dict[str, Recipe] = {
    **_family(pre_image, {
        "pre.stretch": "resize to width x height ignoring aspect",
        "pre.letterbox": "fit inside width x height keeping aspect (round or floor), pad the rest",
        "pre.stretch_crop": "stretch to resize_width x resize_height, then centre-crop width x height",
        "pre.short_side_crop": "short side to short_side keeping aspect, then centre-crop width x height",
        "pre.native": "the frame at its own size, padded right/bottom to a multiple",
        "pre.fit_multiple": "sides limited (PaddleOCR DetResizeForTest), each rounded to a multiple",
    }),
    **_family(pre_height, {
        "pre.fit_height": "to a fixed height, the width from the aspect (text lines, captchas), grey or colour",
    }),
    **_family(post_scores, {
        "post.classes": "logits -> probabilities (classes kind)",
        "post.scores": "logits -> scores by sigmoid or softmax (scores kind)",
    }),
    **_family(post_yolox, {
        "post.yolox": "anchor-free grid/stride decode, objectness x class, NMS -> boxes, scores, class_ids",
    }),
    **_family(post_priors, {
        "post.priors": "SSD/RetinaFace priors with variances, landmarks, NMS -> boxes, scores, keypoints",
    }),
    **_family(post_ctc, {"post.ctc": "CTC greedy decode: argmax, repeats collapsed -> tokens, token_scores"}),
    **_family(post_mask, {"post.saliency": "per-image min-max map resized through geometry to frame size -> mask"}),
    **_family(post_picodet, {
        "post.picodet": "PP-PicoDet anchor-free DFL decode (softmax expectation x stride), per-class NMS -> boxes, "
                        "scores, class_ids",
    }),
}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise UsageError(f"no recipe {name!r} (recipes: {', '.join(sorted(RECIPES))})") from None


def build_graph(name: str, params: Mapping[str, Any] | None = None) -> Any:
    """The checked onnx.ModelProto of recipe `name`; params are typed values or the CLI's strings."""
    r = recipe(name)
    return r.builder(name, resolve(name, r.params, params or {}))


def write_graph(name: str, out: Path, params: Mapping[str, Any] | None = None) -> Path:
    model = build_graph(name, params)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(model.SerializeToString())
    return out
