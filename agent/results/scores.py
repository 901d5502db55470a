"""Result kind `scores`: a score per channel with a declared threshold (one, or one per channel) ->
the scores and the decisions (labels of the channels at or over their threshold).

Judged per sample against the package's own: decision agreement (share of samples deciding the same
labels) and each score within `score_tolerance` of the package's (the worst sample named).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, label_of, rounded, setting
from agent.vocabulary.kinds import Floor, Option
from agent.results.floors import (
    Figures, count_mismatch, json_figures, merge_floors, over, read_pairs, sample_list, under,
)

NAME = "scores"
FIELDS: tuple[Field, ...] = (
    Field("scores", True, (1,), "float", "[C] score per channel"),
)
FLOORS: tuple[Floor, ...] = (
    Floor("min_decision_agreement", 0.98, "share of samples deciding as the package does"),
    Floor("score_tolerance", 0.02, "|served score - package score| allowed"),
)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
# values read from positions in a raw layout: a decoder building it needs the package's answers to be proven
DECODED = False
READS: tuple[str, ...] = ("scores", "raw")
# postprocess.result keys this kind reads besides its fields (and `kind`)
OPTIONS: tuple[Option, ...] = (
    Option("threshold", {"oneOf": [{"type": "number"}, {"type": "array", "items": {"type": "number"}, "minItems": 1}]},
           "a channel is decided at or over it: one number, or a list of one per channel (required)",
           required="kind scores needs a decision threshold"),
)


@dataclass(frozen=True)
class Scores:
    scores: tuple[float | None, ...]
    decisions: frozenset[str]


def thresholds(spec: Any, channels: int) -> np.ndarray:
    """`postprocess.result.threshold`: one number for every channel, or a list of one per channel."""
    t = setting(spec, "threshold")
    if t is None:
        raise BundleError("key postprocess.result.threshold: a scores result needs a decision threshold "
                          "(a number, or a list of one per channel)")
    values = np.asarray(t, np.float64).reshape(-1)
    if values.size == 1:
        return np.full(channels, float(values[0]))
    if values.size != channels:
        raise BundleError(f"key postprocess.result.threshold: {values.size} thresholds for {channels} channels")
    return values


def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    problems = check_fields(tensors, spec, FIELDS, NAME)
    if problems:
        return problems
    try:
        thresholds(spec, int(field_tensors(tensors, spec, FIELDS)["scores"].size))
    except BundleError as exc:
        problems.append(str(exc))
    return problems


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    raw = np.asarray(field_tensors(tensors, spec, FIELDS)["scores"]).reshape(-1)
    s = raw.astype(np.float64)
    # compared in the tensor's own precision: a float32 0.7 is "at" a declared threshold of 0.7
    dtype = raw.dtype if raw.dtype.kind == "f" else np.dtype(np.float64)
    on = np.nan_to_num(raw, nan=-np.inf) >= thresholds(spec, s.size).astype(dtype)  # NaN decides nothing
    return {"type": NAME, "scores": [rounded(v, 6) for v in s],
            "decisions": [label_of(labels, int(i)) for i in np.flatnonzero(on)]}


def normalise(result: Mapping[str, Any]) -> Scores:
    """A `scores` result, or the vocabulary's `raw` result with a decision: its value as the one score and
    its label as the one decision."""
    t = parse.result_type(result, READS, NAME)
    if t == "raw":
        if result.get("decision") is None:
            raise BundleError("field decision: a raw result without a decision cannot be judged as scores "
                              "(declare postprocess.decision)")
        d = parse.mapping(result["decision"], "decision")
        value = parse.number(d.get("value"), "decision.value", allow_none=True)
        label = d.get("label")
        if label is None:
            label = str(parse.integer(parse.field(d, "class_id", "decision."), "decision.class_id"))
        return Scores((value,), frozenset([parse.text(label, "decision.label")]))
    scores = tuple(parse.number(v, f"scores[{i}]", allow_none=True)
                   for i, v in enumerate(parse.items(result, "scores")))
    decisions = frozenset(parse.text(v, f"decisions[{i}]") for i, v in enumerate(parse.items(result, "decisions")))
    return Scores(scores, decisions)


def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    """Figures: decision_agreement (share of samples), disagreements, max_score_diff, scores_over_tolerance
    (values), worst_sample (the first disagreeing sample, else the largest score difference)."""
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None}, [mismatch]
    disagree: list[int] = []
    shown: dict[int, str] = {}
    diffs: list[tuple[float, int, str]] = []
    channel_mismatch: dict[int, str] = {}
    pairs, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    for i, s, a in pairs:
        if s.decisions != a.decisions:
            disagree.append(i)
            shown[i] = f"served {sorted(s.decisions)}, package {sorted(a.decisions)}"
        if len(s.scores) != len(a.scores):
            channel_mismatch[i] = f"{len(s.scores)} served scores for {len(a.scores)} package scores"
            continue
        for c, (x, y) in enumerate(zip(s.scores, a.scores)):
            if y is None:
                continue
            d = float("inf") if x is None else abs(x - y)
            diffs.append((d, i, f"channel {c}: served {x}, package {y:.6g}"))
    n = len(served)
    agree = 1.0 - len(disagree) / n if n else 1.0
    tol = f["score_tolerance"]
    worst = max(diffs, default=None)
    over_tol = [d for d in diffs if d[0] > tol]
    figures: Figures = {
        "decision_agreement": agree, "disagreements": len(disagree),
        "max_score_diff": worst[0] if worst else None, "scores_over_tolerance": len(over_tol),
        "worst_sample": disagree[0] if disagree else (worst[1] if worst and worst[0] > 0 else None),
    }
    findings: list[Finding] = []
    if agree < f["min_decision_agreement"]:
        findings.append(under(f"decision agreement (share of {n} samples)", agree, f["min_decision_agreement"],
                                 stage, disagree[0], f"{shown[disagree[0]]}; {len(disagree)} samples decide "
                                 f"otherwise: {sample_list(disagree)}"))
    if worst is not None and over_tol:
        findings.append(over("|score - package score|", worst[0], tol, stage, worst[1],
                             f"{worst[2]}; {len(over_tol)} of {len(diffs)} scores over the tolerance"))
    if channel_mismatch:
        i = min(channel_mismatch)
        findings.append(Finding("fidelity", "samples whose score channels differ from the package's",
                                float(len(channel_mismatch)), 0.0, stage, i,
                                f"sample {i}: {channel_mismatch[i]}; samples {sample_list(sorted(channel_mismatch))}",
                                "over"))
    return json_figures(figures), unreadable + findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    decided = {normalise(a).decisions for a in answers}
    if len(answers) > 1 and len(decided) == 1:
        return [f"every golden sample's package decision is {sorted(decided.pop())}: decision agreement cannot "
                "fail on this set (only the score tolerance judges it); add samples that decide otherwise"]
    return []
