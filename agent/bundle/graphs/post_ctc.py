"""CTC greedy decode (PaddleOCR's CTCLabelDecode): per-step argmax and max, repeats collapsed -> `tokens`, `token_scores`.

Blanks are dropped in the graph (drop_blank, the default) or kept for the text kind to drop; either way
the text kind's string is the same. The charset and its offset live in the bundle's `postprocess.result`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, INT64, Graph
from agent.bundle.graphs.params import Param, describe

PARAMS: dict[str, dict[str, Param]] = {
    "post.ctc": {
        "input": Param("str", "output", "the model output [1, T, C] of per-step class probabilities"),
        "blank": Param("int", 0, "the blank class id", minimum=0),
        "drop_blank": Param("bool", True, "drop blanks in the graph (false: keep them for the text kind to drop)"),
        "softmax": Param("bool", False, "the output is logits: softmax per step first (token scores are probabilities)"),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    g = Graph(recipe.replace(".", "_"))
    x = g.squeeze(g.input(p["input"], FLOAT, [1, "steps", "classes"]), [0])  # [T, C]
    if p["softmax"]:
        x = g.op("Softmax", x, axis=1)
    ids = g.op("ArgMax", x, axis=1, keepdims=0)  # [T] int64, first maximum on ties (numpy's argmax)
    probs = g.op("ReduceMax", x, axes=[1], keepdims=0)
    previous = g.concat([g.const([-1], INT64), g.slice(ids, [0], [-1], [0])], 0)
    keep = g.op("Not", g.op("Equal", ids, previous))  # selection[1:] = ids[1:] != ids[:-1]
    if p["drop_blank"]:
        keep = g.op("And", keep, g.op("Not", g.op("Equal", ids, g.const(p["blank"], INT64))))
    g.output(g.op("Compress", ids, keep, axis=0), "tokens", INT64, ["tokens"])
    g.output(g.op("Compress", probs, keep, axis=0), "token_scores", FLOAT, ["tokens"])
    return g.model(f"{recipe}: {describe(p)}")
