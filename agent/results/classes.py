"""Result kind `classes`: a probability per class -> the top classes with labels and scores.

Judged per sample against the package's own top-1 (margin-aware, with a Wilson interval as the vocabulary's
classification is) AND by score: the served probability of the package's top-1 class within `score_tolerance`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.proof.agreement import wilson_interval
from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, label_of, rounded, setting
from agent.vocabulary.kinds import Floor, Option
from agent.results.floors import (
    Figures, count_mismatch, json_figures, merge_floors, over, read_pairs, sample_list, under,
)

NAME = "classes"
FIELDS: tuple[Field, ...] = (
    Field("probabilities", True, (1,), "float", "[C] probability (or score) per class, one sample"),
)
FLOORS: tuple[Floor, ...] = (
    Floor("min_top1_agreement", 0.98, "share of samples whose top-1 class is the package's"),
    Floor("score_tolerance", 0.02, "|served score - package score| of the package's top-1 class allowed"),
    Floor("negligible_margin", 0.02, "a swap of the package's top-1 and top-2 is not counted where their margin is under this"),
)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
# values read from positions in a raw layout: a decoder building it needs the package's answers to be proven
DECODED = False
READS: tuple[str, ...] = ("classes", "classification")
# postprocess.result keys this kind reads besides its fields (and `kind`)
OPTIONS: tuple[Option, ...] = (
    Option("top_k", {"type": "integer", "minimum": 1, "default": 5}, "how many classes are served, best first (default 5)"),
)
DEFAULT_TOP_K = 5


@dataclass(frozen=True)
class ClassScore:
    class_id: int
    label: str
    score: float | None  # None: the served score was not finite


@dataclass(frozen=True)
class Classes:
    """One sample's classes, best first."""

    top: tuple[ClassScore, ...]

    def score_of(self, class_id: int) -> float | None:
        return next((c.score for c in self.top if c.class_id == class_id), None)

    def has(self, class_id: int) -> bool:
        return any(c.class_id == class_id for c in self.top)


def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    problems = check_fields(tensors, spec, FIELDS, NAME)
    found = field_tensors(tensors, spec, FIELDS)
    if not problems and found["probabilities"].size == 0:
        problems.append(f"result {NAME} field 'probabilities' is empty: one value per class wanted")
    return problems


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    p = np.asarray(field_tensors(tensors, spec, FIELDS)["probabilities"], dtype=np.float64).reshape(-1)
    k = min(int(setting(spec, "top_k", DEFAULT_TOP_K)), p.size)
    order = np.argsort(-np.nan_to_num(p, nan=-np.inf), kind="stable")[:k]
    return {"type": NAME, "top": [{"class_id": int(i), "label": label_of(labels, int(i)),
                                   "score": rounded(p[i], 6)} for i in order]}


def normalise(result: Mapping[str, Any]) -> Classes:
    """A `classes` result or the vocabulary's `classification` (same `top` list), best first."""
    parse.result_type(result, READS, NAME)
    top = []
    for i, entry in enumerate(parse.items(result, "top")):
        where = f"top[{i}]."
        e = parse.mapping(entry, f"top[{i}]")
        cid = parse.integer(parse.field(e, "class_id", where), where + "class_id")
        label = e.get("label")
        top.append(ClassScore(cid, str(cid) if label is None else parse.text(label, where + "label"),
                              parse.number(parse.field(e, "score", where), where + "score", allow_none=True)))
    if not top:
        raise BundleError("field top: empty; at least the top-1 class wanted")
    # best first, whatever order the writer used (a non-finite served score sorts last)
    top.sort(key=lambda c: -np.inf if c.score is None else -c.score)
    return Classes(tuple(top))


def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    """Figures: top1_agreement, top1_flips, top1_counted, top1_ignored_negligible_margin, top1_wilson_high,
    max_score_diff, scores_over_tolerance, worst_sample (the first flip, else the largest score difference)."""
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None}, [mismatch]
    flips: list[int] = []
    counted = ignored = 0
    diffs: list[tuple[float, int, str]] = []  # (|diff|, sample, what) per sample
    pairs, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    for i, s, a in pairs:
        want = a.top[0]
        margin = (want.score or 0.0) - (a.top[1].score or 0.0) if len(a.top) > 1 else float("inf")
        pick = s.top[0]
        if pick.score is None:
            counted += 1
            flips.append(i)
        elif margin < f["negligible_margin"] and len(a.top) > 1 and pick.class_id == a.top[1].class_id:
            ignored += 1
        else:
            counted += 1
            if pick.class_id != want.class_id:
                flips.append(i)
        got = s.score_of(want.class_id)
        if want.score is None:
            continue
        if got is None:
            why = ("not in the served top" if not s.has(want.class_id) else "not finite when served")
            diffs.append((float("inf"), i, f"class {want.class_id} ({want.label}) {why}"))
        else:
            diffs.append((abs(got - want.score), i, f"class {want.class_id} ({want.label}): served {got:.6g}, "
                                                    f"package {want.score:.6g}"))
    agree = (counted - len(flips)) / counted if counted else 1.0
    _, high = wilson_interval(counted - len(flips), counted)
    tol = f["score_tolerance"]
    worst_diff = max(diffs, default=None)
    over_tol = [d for d in diffs if d[0] > tol]
    figures: Figures = {
        "top1_agreement": agree, "top1_flips": len(flips), "top1_counted": counted,
        "top1_ignored_negligible_margin": ignored, "top1_wilson_high": high,
        "max_score_diff": None if worst_diff is None else worst_diff[0],
        "scores_over_tolerance": len(over_tol),
        "worst_sample": flips[0] if flips else (worst_diff[1] if worst_diff and worst_diff[0] > 0 else None),
    }
    findings: list[Finding] = []
    floor = f["min_top1_agreement"]
    # refuse only when even the interval's upper end is under the floor: 1 flip in 32 is no cliff
    if agree < floor and high < floor:
        findings.append(under(f"top-1 agreement (share of {counted} samples)", agree, floor, stage, flips[0],
                              f"{len(flips)} samples pick another top-1 than the package: {sample_list(flips)}; "
                              f"Wilson upper {high:.4g}; {ignored} ignored (package margin < "
                              f"{f['negligible_margin']:g})"))
    if worst_diff is not None and over_tol:
        findings.append(over("|score - package score| of the package's top-1 class", worst_diff[0], tol, stage,
                             worst_diff[1], f"{worst_diff[2]}; {len(over_tol)} of {len(diffs)} samples over "
                             f"the tolerance"))
    return json_figures(figures), unreadable + findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    """A golden set whose package top-1 is one class everywhere cannot fail top-1 agreement."""
    tops = {normalise(a).top[0].class_id for a in answers}
    if len(answers) > 1 and len(tops) == 1:
        return [f"every golden sample's package top-1 is class {tops.pop()}: top-1 agreement cannot fail on "
                "this set (only the score tolerance judges it); add samples of other classes"]
    return []
