"""post.ctc (agent/bundle/graphs/post_ctc.py) in a real session against PaddleOCR's CTCLabelDecode
(ppocr/postprocess/rec_postprocess.py: argmax/max per step, is_remove_duplicate, blank 0 ignored, mean score)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402

CHARACTER = ["blank", *"0123456789abcdefghijklmnopqrstuvwxyz", " "]  # dict chars, use_space_char


def ctc_label_decode(preds: np.ndarray) -> tuple[str, float, np.ndarray]:
    """CTCLabelDecode.__call__ for one sample: (text, mean confidence, the kept scores)."""
    text_index, text_prob = preds.argmax(axis=2)[0], preds.max(axis=2)[0]
    selection = np.ones(len(text_index), dtype=bool)
    selection[1:] = text_index[1:] != text_index[:-1]
    selection &= text_index != 0
    chars = [CHARACTER[i] for i in text_index[selection]]
    conf = text_prob[selection]
    return "".join(chars), float(np.mean(conf if len(conf) else [0])), conf


def kind_text(tokens: np.ndarray, scores: np.ndarray, blank: int = 0) -> tuple[str, float]:
    """What the text kind does with the graph's tokens: drop blanks, look up the charset."""
    keep = tokens != blank
    s = scores[keep]
    return "".join(CHARACTER[i] for i in tokens[keep]), float(np.mean(s if len(s) else [0]))


def encode(text: str, steps: int, rng: np.random.Generator) -> np.ndarray:
    """A CTC alignment of `text` over `steps` (repeats, blanks between doubled letters), as peaked softmax rows."""
    ids: list[int] = []
    for i, ch in enumerate(text):
        c = CHARACTER.index(ch)
        if i and text[i - 1] == ch:
            ids.append(0)
        ids += [c] * int(rng.integers(1, 3))
        if rng.random() < 0.5:
            ids += [0] * int(rng.integers(1, 3))
    ids += [0] * (steps - len(ids))
    logits = rng.normal(0, 1, (steps, len(CHARACTER)))
    logits[np.arange(steps), ids] += 8.0
    e = np.exp(logits - logits.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True))[None].astype(np.float32)


def run(params: dict[str, Any], preds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sess = ort.InferenceSession(build_graph("post.ctc", params).SerializeToString(), providers=[CPU])
    tokens, scores = sess.run(["tokens", "token_scores"], {"output": preds})
    return tokens, scores


@pytest.mark.parametrize("steps", [40, 80])
@pytest.mark.parametrize("drop_blank", [True, False])
def test_structured_lines_decode_to_the_package_text(steps: int, drop_blank: bool) -> None:
    rng = np.random.default_rng(steps)
    for text in ["hello", "aabb  cc", "1001", "z"]:
        preds = encode(text, steps, rng)
        want, conf, kept = ctc_label_decode(preds)
        assert want == text
        tokens, scores = run({"drop_blank": drop_blank}, preds)
        assert tokens.dtype == np.int64 and scores.shape == tokens.shape
        got, got_conf = kind_text(tokens, scores)
        assert got == want
        assert abs(got_conf - conf) < 1e-6
        if drop_blank:
            np.testing.assert_allclose(scores, kept, rtol=1e-6)
            assert 0 not in tokens


@pytest.mark.parametrize("steps", [25, 120])
def test_random_rows_decode_like_ctc_label_decode(steps: int) -> None:
    rng = np.random.default_rng(steps + 1)
    for _ in range(5):
        logits = rng.normal(0, 2, (1, steps, len(CHARACTER)))
        logits[..., 0] += 4.0  # blanks common, as in real lines
        e = np.exp(logits - logits.max(2, keepdims=True))
        preds = (e / e.sum(2, keepdims=True)).astype(np.float32)
        want, conf, _ = ctc_label_decode(preds)
        assert len(want) > 0
        got, got_conf = kind_text(*run({}, preds))
        assert (got, round(got_conf, 6)) == (want, round(conf, 6))
        kept_blank = run({"drop_blank": False}, preds)
        assert kind_text(*kept_blank)[0] == want and (kept_blank[0] == 0).any()


def test_logits_input_is_softmaxed_for_the_scores() -> None:
    rng = np.random.default_rng(3)
    preds = encode("abc", 30, rng)
    logits = np.log(preds) + rng.normal(0, 0.1, (1, 30, 1)).astype(np.float32)  # a per-step shift: same softmax
    tokens, scores = run({"softmax": True}, logits)
    want, conf, kept = ctc_label_decode(preds)
    assert kind_text(tokens, scores)[0] == want
    np.testing.assert_allclose(scores, kept, rtol=1e-5)


def test_an_all_blank_line_is_empty() -> None:
    preds = np.zeros((1, 12, len(CHARACTER)), np.float32)
    preds[..., 0] = 1.0
    tokens, scores = run({}, preds)
    assert tokens.shape == (0,) and scores.shape == (0,)
