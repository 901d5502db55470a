"""Result kind `classes`: top-1 agreement against the package's own top-1 (margin-aware, with an interval)
and the served score of the package's top-1 class within a tolerance; a one-class golden set is flagged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import classes, kind_reading


def _res(*top: tuple[int, float]) -> dict[str, Any]:
    return {"type": "classes", "top": [{"class_id": c, "label": f"c{c}", "score": s} for c, s in top]}


def test_score_off_by_026_with_top1_kept_fails_tolerance() -> None:
    # issue 21: every golden frame one class, scores off by up to 0.26 passed on top-1 alone
    package = [_res((3, 0.9), (1, 0.05)) for _ in range(10)]
    served = list(package)
    served[6] = _res((3, 0.64), (1, 0.3))
    figures, findings = classes.fidelity(served, package)
    [f] = findings
    assert f.metric == "|score - package score| of the package's top-1 class"
    assert f.value == pytest.approx(0.26) and f.bound == 0.02 and f.sample == 6 and f.stage == "post"
    assert figures["top1_agreement"] == 1.0 and figures["max_score_diff"] == pytest.approx(0.26)
    assert classes.golden_warnings(package)  # and the set could never have failed top-1


def test_flips_fail_top1_and_name_the_first_flipped_sample() -> None:
    rng = np.random.default_rng(0)
    package = [_res((int(c), 0.8), (int(c) + 1, 0.1)) for c in rng.integers(0, 5, 40)]
    served = list(package)
    for i in (7, 20, 31):
        c = package[i]["top"][0]["class_id"]
        served[i] = _res((c + 2, 0.7), (c, 0.2))
    figures, findings = classes.fidelity(served, package, {"score_tolerance": 1.0})
    [f] = findings
    assert f.metric.startswith("top-1 agreement") and f.sample == 7 and f.value == pytest.approx(37 / 40)
    assert "7, 20, 31" in f.detail and figures["top1_flips"] == 3


def test_one_flip_in_32_is_no_cliff_but_a_negligible_margin_swap_is_not_counted() -> None:
    package = [_res((1, 0.9), (0, 0.05)) for _ in range(32)]
    served = list(package)
    served[0] = _res((0, 0.9), (1, 0.05))
    _, findings = classes.fidelity(served, package, {"score_tolerance": 1.0})
    assert findings == []  # the Wilson upper end is over 0.98
    package = [_res((1, 0.50), (0, 0.49))]
    served = [_res((0, 0.50), (1, 0.495))]
    figures, findings = classes.fidelity(served, package)
    assert figures["top1_ignored_negligible_margin"] == 1 and findings == []


def test_package_top1_missing_from_served_top_fails_the_score() -> None:
    package = [_res((4, 0.6), (2, 0.3))]
    served = [_res((2, 0.61))]  # top_k 1 and a flip: class 4 was not served at all
    figures, findings = classes.fidelity(served, package, {"min_top1_agreement": 0.0})
    [f] = findings
    assert f.value == float("inf") and "not in the served top" in f.detail
    assert figures["max_score_diff"] is None  # strict JSON: no inf in figures


def test_compact_is_top_k_of_the_probabilities_with_labels() -> None:
    t = {"probs": np.array([[0.1, 0.6, 0.3]], np.float32)}
    spec = {"kind": "classes", "probabilities": "probs", "top_k": 2}
    assert classes.check(t, spec) == []
    r = classes.compact(t, spec, labels=["a", "b", "c"])
    assert r == {"type": "classes", "top": [{"class_id": 1, "label": "b", "score": pytest.approx(0.6)},
                                            {"class_id": 2, "label": "c", "score": pytest.approx(0.3)}]}
    assert classes.check({"probs": np.zeros((2, 3), np.float32)}, spec)[0].endswith(
        "rank 1 wanted ([C] probability (or score) per class, one sample)")


def test_normalise_accepts_the_vocabularys_classification_result() -> None:
    from agent.vocabulary.decoders import decode
    from agent.vocabulary.manifest import PostprocessSpec

    vocab = decode(PostprocessSpec(type="classification", output="logits", top_k=3),
                   {"logits": np.array([0.0, 3.0, 1.0], np.float32)}, labels=["x", "y", "z"])
    value = classes.normalise(vocab)
    assert value.top[0].class_id == 1 and value.top[0].label == "y"
    assert kind_reading("classification") is classes
    with pytest.raises(BundleError, match=r"field top\[0\]\.class_id: a whole number wanted, found 1.5"):
        classes.normalise({"type": "classes", "top": [{"class_id": 1.5, "score": 0.2}]})
    with pytest.raises(BundleError, match="field top: empty"):
        classes.normalise({"type": "classes", "top": []})


def test_golden_set_of_several_classes_does_not_warn() -> None:
    assert classes.golden_warnings([_res((0, 0.9)), _res((1, 0.9))]) == []
