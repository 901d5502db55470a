"""Result kind `peak` (a throwaway for tests/results/test_result_kind_plugin.py): the index and value of the largest of
C values. One module, registered from the test alone: nothing else in the tree names it.

Judged per sample by index: the share of samples whose peak is the package's, floor `min_peak_agreement`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, rounded
from agent.results.floors import Figures, count_mismatch, json_figures, merge_floors, read_pairs, under
from agent.vocabulary.kinds import Floor, Option

NAME = "peak"
FIELDS: tuple[Field, ...] = (Field("values", True, (1,), "float", "[C] values whose largest is served"),)
FLOORS: tuple[Floor, ...] = (Floor("min_peak_agreement", 0.9, "share of samples whose peak index is the package's"),)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
DECODED = False
READS: tuple[str, ...] = ("peak",)
OPTIONS: tuple[Option, ...] = (
    Option("digits", {"type": "integer", "minimum": 0, "maximum": 9}, "decimals the value is served with (default 4)"),
)


def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    return check_fields(tensors, spec, FIELDS, NAME)


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    v = np.asarray(field_tensors(tensors, spec, FIELDS)["values"], np.float64).reshape(-1)
    digits = int((spec.get("digits") if isinstance(spec, Mapping) else None) or 4)
    i = int(np.argmax(v))
    return {"type": NAME, "index": i, "value": rounded(v[i], digits)}


def normalise(result: Mapping[str, Any]) -> int:
    parse.result_type(result, READS, NAME)
    return parse.integer(parse.field(result, "index", ""), "index")


def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None}, [mismatch]
    pairs, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    wrong = [i for i, s, a in pairs if s != a]
    agreement = 1.0 - len(wrong) / max(len(answers), 1)
    findings = list(unreadable)
    if agreement < f["min_peak_agreement"]:
        findings.append(under("peak_agreement", agreement, f["min_peak_agreement"], stage, wrong[0] if wrong else None))
    return json_figures({"peak_agreement": agreement, "worst_sample": wrong[0] if wrong else None}), findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    return []
