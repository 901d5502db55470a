"""Score post graphs: a model's logits [1, C] [1, C] -> `probabilities` or `scores` [C].

post.classes feeds the classes kind (softmax over classes); post.scores feeds the scores kind (sigmoid per
channel, or softmax), whose decisions come from `postprocess.result.threshold`.
"""

from __future__ import annotations

from typing import Any

from agent.bundle.graphs.builder import FLOAT, Graph
from agent.bundle.graphs.params import Param, describe

PARAMS: dict[str, dict[str, Param]] = {
    "post.classes": {
        "input": Param("str", "logits", "the model output holding the class logits, shape [1, C]"),
        "activation": Param("str", "softmax", "softmax over classes, or none when the model outputs probabilities",
                            ("softmax", "none")),
    },
    "post.scores": {
        "input": Param("str", "output", "the model output holding the scores, shape [1, C]"),
        "activation": Param("str", "sigmoid", "sigmoid per channel, softmax over channels, or none",
                            ("sigmoid", "softmax", "none")),
    },
}


def build(recipe: str, p: dict[str, Any]) -> Any:
    g = Graph(recipe.replace(".", "_"))
    x = g.reshape(g.input(p["input"], FLOAT, [1, "classes"]), [-1])
    if p["activation"] == "softmax":
        x = g.op("Softmax", x, axis=0)
    elif p["activation"] == "sigmoid":
        x = g.op("Sigmoid", x)
    name = "probabilities" if recipe == "post.classes" else "scores"
    g.output(x, name, FLOAT, ["classes"])
    return g.model(f"{recipe}: {describe(p)}")
