"""Result kind `text`: token ids and the bundle's charset -> a string (blank dropped, offset applied),
judged by exact match and character error rate against the package's own text, the worst sample named."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import text

CHARSET = text.read_charset("a\nb\nc\nd\ne\nh\nl\no\n \n")


def _res(s: str) -> dict[str, Any]:
    return {"type": "text", "text": s, "confidence": None, "chars": []}


def test_hello_against_helo_has_cer_02_and_fails_both_floors() -> None:
    figures, findings = text.fidelity([_res("helo")], [_res("hello")])
    assert figures["cer"] == pytest.approx(0.2) and figures["exact_match"] == 0.0
    assert text.cer("helo", "hello") == pytest.approx(0.2)  # edits / the PACKAGE's length, not the served one
    assert [f.metric for f in findings] == ["exact text match (share of 1 samples)",
                                           "character error rate (pooled over 1 samples)"]
    assert findings[1].value == pytest.approx(0.2) and findings[1].bound == 0.02 and findings[1].sample == 0
    assert figures["max_sample_cer"] == pytest.approx(0.2) and "worst sample 0: CER 0.2," in findings[1].detail


def test_cer_is_pooled_over_characters_not_a_mean_of_samples() -> None:
    figures, _ = text.fidelity([_res("ab"), _res("abcdefghiX")], [_res("ab"), _res("abcdefghij")])
    assert figures["cer"] == pytest.approx(1 / 12)  # a mean of per-sample rates would say 0.05
    assert figures["worst_sample"] == 1 and figures["max_sample_cer"] == pytest.approx(0.1)


def test_one_wrong_sample_in_100_passes_exact_match_but_its_cer_is_named() -> None:
    package = [_res("hello world") for _ in range(100)]
    served = list(package)
    served[42] = _res("hellp world")
    figures, findings = text.fidelity(served, package, {"max_cer": 0.0005})
    assert figures["exact_match"] == 0.99 and figures["worst_sample"] == 42
    [f] = findings
    assert f.metric.startswith("character error rate (pooled") and f.sample == 42
    assert f.value == pytest.approx(1 / 1100) and "worst sample 42: CER 0.09091" in f.detail


def test_compact_drops_blank_applies_charset_offset_and_scores_characters() -> None:
    # ids as a PaddleOCR-style head gives them: blank 0, the charset starting at id 1
    ids = np.array([6, 5, 7, 7, 0, 8], np.int64)
    t = {"ids": ids, "conf": np.array([0.9, 0.8, 0.7, 0.6, 0.1, 1.0], np.float32)}
    spec = {"kind": "text", "tokens": "ids", "token_scores": "conf", "blank": 0, "charset_offset": 1}
    assert text.check(t, spec) == []
    r = text.compact(t, spec, charset=CHARSET)
    assert r["text"] == "hello"
    assert r["confidence"] == pytest.approx(np.mean([0.9, 0.8, 0.7, 0.6, 1.0]), abs=1e-6)
    assert [c["char"] for c in r["chars"]] == list("hello")
    assert r["chars"][4]["score"] == 1.0
    with pytest.raises(BundleError, match="token id 99 is beyond the charset"):
        text.compact({"ids": np.array([99])}, spec, charset=CHARSET)


def test_charset_keeps_a_space_line_and_drops_only_the_final_newline() -> None:
    assert CHARSET[-1] == " " and len(CHARSET) == 9
    assert text.read_charset("x\r\ny") == ("x", "y")
    assert text.read_charset("\ufeffx\ny\n") == ("x", "y")  # an editor's byte-order mark is not id 0


def test_check_names_float_ids_and_disagreeing_lengths() -> None:
    assert "whole numbers" in text.check({"tokens": np.array([1.5], np.float32)}, {})[0]
    assert "disagree" in text.check({"tokens": np.array([1, 2]), "token_scores": np.ones(3, np.float32)}, {})[0]
    assert "negative" in text.check({"tokens": np.array([-1, 2])}, {})[0]


def test_golden_set_of_one_constant_string_warns() -> None:
    assert text.golden_warnings([_res("stop"), _res("stop")])
    assert "empty" in text.golden_warnings([_res(""), _res("")])[0]
    assert text.golden_warnings([_res("stop"), _res("go")]) == []


def test_normalise_errors_name_the_field() -> None:
    with pytest.raises(BundleError, match="field text: a string wanted"):
        text.normalise({"type": "text", "text": 3})
