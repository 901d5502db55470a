"""Score post recipes (agent/bundle/graphs/post_scores.py) in real sessions against numpy softmax/sigmoid."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("classes", [2, 10, 1000])
def test_classes_post_is_softmax_over_the_logits(classes: int) -> None:
    sess = ort.InferenceSession(build_graph("post.classes", {"input": "logits"}).SerializeToString(), providers=[CPU])
    rng = np.random.default_rng(classes)
    for scale in (1.0, 30.0):  # large logits: the graph's softmax must not overflow
        logits = (rng.standard_normal((1, classes)) * scale).astype(np.float32)
        (probs,) = sess.run(["probabilities"], {"logits": logits})
        assert probs.shape == (classes,)
        np.testing.assert_allclose(probs, softmax(logits[0].astype(np.float64)), atol=1e-6)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax", "none"])
def test_scores_post_applies_the_declared_activation(activation: str) -> None:
    model = build_graph("post.scores", {"input": "out", "activation": activation})
    sess = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    x = np.random.default_rng(1).standard_normal((1, 7)).astype(np.float32) * 4
    (scores,) = sess.run(["scores"], {"out": x})
    want = {"sigmoid": 1 / (1 + np.exp(-x[0].astype(np.float64))), "softmax": softmax(x[0].astype(np.float64)),
            "none": x[0]}[activation]
    np.testing.assert_allclose(scores, want, atol=1e-6)
