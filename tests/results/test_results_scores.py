"""Result kind `scores`: decisions at a declared threshold (one, or per channel) and scores judged within a
tolerance of the package's, per sample; the vocabulary's raw decision is read too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import kind_reading, scores


def _res(values: list[float], threshold: float | list[float] = 0.5, labels: tuple[str, ...] = ()) -> dict[str, Any]:
    return scores.compact({"scores": np.asarray(values, np.float32)}, {"threshold": threshold}, labels)


def test_compact_decides_at_or_over_each_channels_threshold() -> None:
    r = _res([0.2, 0.5, 0.7], [0.1, 0.6, 0.7], ("speech", "music", "noise"))
    assert r["decisions"] == ["speech", "noise"]
    assert r["scores"] == [pytest.approx(0.2), pytest.approx(0.5), pytest.approx(0.7)]
    with pytest.raises(BundleError, match="2 thresholds for 3 channels"):
        _res([0.2, 0.5, 0.7], [0.1, 0.6])
    assert "needs a decision threshold" in scores.check({"scores": np.zeros(3, np.float32)}, {})[0]


def test_a_flipped_decision_fails_agreement_and_names_the_sample() -> None:
    package = [_res([0.9, 0.1]) for _ in range(10)]
    served = list(package)
    served[3] = _res([0.45, 0.1])
    figures, findings = scores.fidelity(served, package, {"score_tolerance": 1.0})
    [f] = findings
    assert f.metric.startswith("decision agreement") and f.sample == 3 and f.value == pytest.approx(0.9)
    assert "served [], package ['0']" in f.detail
    assert figures["decision_agreement"] == pytest.approx(0.9)


def test_score_off_by_003_with_every_decision_kept_fails_tolerance() -> None:
    package = [_res([0.9, 0.1]) for _ in range(5)]
    served = list(package)
    served[2] = _res([0.9, 0.13])
    figures, findings = scores.fidelity(served, package)
    [f] = findings
    assert f.metric == "|score - package score|" and f.sample == 2 and f.value == pytest.approx(0.03, abs=1e-6)
    assert "channel 1" in f.detail and figures["decision_agreement"] == 1.0


def test_normalise_reads_the_vocabularys_raw_decision() -> None:
    from agent.vocabulary.decoders import decode
    from agent.vocabulary.manifest import DecisionSpec, PostprocessSpec

    spec = PostprocessSpec(type="raw", outputs=("p",), max_values=0,
                           decision=DecisionSpec(rule="threshold", threshold=0.5, labels=("silence", "speech")))
    vocab = decode(spec, {"p": np.array([[0.8]], np.float32)})
    value = scores.normalise(vocab)
    assert value.decisions == frozenset({"speech"}) and value.scores == (pytest.approx(0.8),)
    assert kind_reading("raw") is scores
    other = decode(spec, {"p": np.array([[0.3]], np.float32)})
    figures, findings = scores.fidelity([other], [vocab])
    assert figures["decision_agreement"] == 0.0 and findings[0].sample == 0
    with pytest.raises(BundleError, match="raw result without a decision"):
        scores.normalise({"type": "raw", "outputs": {}})


def test_channel_count_change_is_named() -> None:
    _, findings = scores.fidelity([_res([0.9])], [_res([0.9, 0.1])], {"min_decision_agreement": 0.0})
    assert findings[0].metric == "samples whose score channels differ from the package's"
    assert findings[0].sample == 0 and "1 served scores for 2 package scores" in findings[0].detail


def test_golden_set_that_always_decides_the_same_warns() -> None:
    assert scores.golden_warnings([_res([0.9]), _res([0.8])])
    assert scores.golden_warnings([_res([0.9]), _res([0.1])]) == []
