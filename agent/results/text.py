"""Result kind `text`: token ids (after the graph's CTC collapse) and a charset file in the bundle ->
a string with a confidence and per-character scores.

Judged per sample against the package's own string: exact match (share of samples) and character error
rate (edit distance / package length, pooled; the worst sample named with its own CER).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, lengths_agree, rounded, setting
from agent.vocabulary.kinds import Floor, Option
from agent.results.floors import (
    Figures, count_mismatch, json_figures, merge_floors, over, read_pairs, sample_list, under,
)

NAME = "text"
FIELDS: tuple[Field, ...] = (
    Field("tokens", True, (1,), "number", "[T] token ids after the CTC collapse (blank ids are dropped here)",
          integral=True),
    Field("token_scores", False, (1,), "float", "[T] score per token"),
)
FLOORS: tuple[Floor, ...] = (
    Floor("min_exact_match", 0.98, "share of samples whose text equals the package's"),
    Floor("max_cer", 0.02, "character error rate allowed"),
)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
# values read from positions in a raw layout: a decoder building it needs the package's answers to be proven
DECODED = True
READS: tuple[str, ...] = ("text",)
# postprocess.result keys this kind reads besides its fields (and `kind`)
OPTIONS: tuple[Option, ...] = (
    Option("charset", {"type": "string"}, "a file in the bundle, one entry per line (read by the caller, passed to "
           "compact)", required="kind text needs a charset file (one character per line, line i is token id i + "
           "charset_offset)"),
    Option("charset_offset", {"type": "integer", "minimum": 0, "default": 0},
           "token id i is charset line i - charset_offset (default 0)"),
    Option("blank", {"type": "integer", "minimum": 0, "default": 0}, "token id dropped as the CTC blank (default 0)"),
)
DEFAULT_BLANK = 0


@dataclass(frozen=True)
class Text:
    text: str
    confidence: float | None


def read_charset(content: str) -> tuple[str, ...]:
    """A charset file: one entry per line (a line holding a space is the space), line i is id i. A UTF-8
    byte-order mark some editors write is not part of the first entry."""
    lines = content.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's last newline ends the last line, it starts no empty entry
    return tuple(line.removesuffix("\r") for line in lines)


def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    problems = check_fields(tensors, spec, FIELDS, NAME)
    if problems:
        return problems
    found = field_tensors(tensors, spec, FIELDS)
    problems += lengths_agree(found, ["tokens", "token_scores"], NAME)
    if found["tokens"].size and float(np.min(found["tokens"])) < 0:
        problems.append(f"result {NAME} field 'tokens': negative token ids")
    return problems


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    """Ids equal to `blank` dropped; id i is charset line i - `charset_offset`; confidence the mean token
    score (None without token scores or without characters)."""
    found = field_tensors(tensors, spec, FIELDS)
    tokens = np.asarray(found["tokens"]).reshape(-1).astype(np.int64)
    scores = found.get("token_scores")
    s = None if scores is None else np.asarray(scores, np.float64).reshape(-1)
    blank = int(setting(spec, "blank", DEFAULT_BLANK))
    offset = int(setting(spec, "charset_offset", 0))
    chars: list[str] = []
    char_scores: list[float | None] = []
    for j, t in enumerate(tokens):
        if t == blank:
            continue
        k = int(t) - offset
        if not 0 <= k < len(charset):
            raise BundleError(f"result {NAME}: token id {int(t)} is beyond the charset ({len(charset)} entries, "
                              f"charset_offset {offset}): postprocess.result.charset does not match the model")
        chars.append(charset[k])
        char_scores.append(None if s is None else rounded(s[j], 6))
    kept = [c for c in char_scores if c is not None]
    confidence = rounded(float(np.mean(kept)), 6) if kept else None
    return {"type": NAME, "text": "".join(chars), "confidence": confidence,
            "chars": [{"char": c, "score": v} for c, v in zip(chars, char_scores)]}


def normalise(result: Mapping[str, Any]) -> Text:
    parse.result_type(result, READS, NAME)
    text = parse.text(parse.field(result, "text", ""), "text")
    return Text(text, parse.number(result.get("confidence"), "confidence", allow_none=True))


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def cer(served: str, package: str) -> float:
    """Character error rate of one sample: edits / package length (an empty package string: edits)."""
    return edit_distance(served, package) / max(len(package), 1)


def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    """Figures: exact_match (share of samples), cer (edits / characters, pooled over samples), max_sample_cer,
    mismatched, worst_sample (the highest CER of one sample)."""
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None}, [mismatch]
    edits = chars = 0
    per: dict[int, float] = {}  # CER by sample index
    texts: dict[int, tuple[str, str]] = {}
    wrong: list[int] = []
    values, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    for i, s_value, a_value in values:
        s, a = s_value.text, a_value.text
        d = edit_distance(s, a)
        edits, chars = edits + d, chars + len(a)
        per[i] = cer(s, a)
        texts[i] = (s, a)
        if s != a:
            wrong.append(i)
    n = len(per)
    exact = 1.0 - len(wrong) / n if n else 1.0
    pooled = edits / max(chars, 1)
    worst = max(per, key=lambda i: (per[i], -i)) if per and max(per.values()) > 0 else None
    figures: Figures = {"exact_match": exact, "cer": pooled, "max_sample_cer": max(per.values(), default=0.0),
                        "mismatched": len(wrong), "worst_sample": worst}
    findings: list[Finding] = []
    if exact < f["min_exact_match"]:
        s, a = texts[wrong[0]]
        findings.append(under(f"exact text match (share of {n} samples)", exact, f["min_exact_match"], stage,
                              wrong[0], f"served {s!r}, package {a!r}; {len(wrong)} samples differ: "
                              f"{sample_list(wrong)}"))
    if pooled > f["max_cer"] and worst is not None:
        s, a = texts[worst]
        findings.append(over(f"character error rate (pooled over {n} samples)", pooled, f["max_cer"], stage, worst,
                             f"{edits} edits over {chars} package characters; worst sample {worst}: CER "
                             f"{per[worst]:.4g}, served {s!r}, package {a!r}"))
    return json_figures(figures), unreadable + findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    texts = [normalise(a).text for a in answers]
    if texts and not any(texts):
        return ["every golden sample's package text is empty: an empty served text matches it everywhere; add "
                "frames with text"]
    if len(texts) > 1 and len(set(texts)) == 1:
        return [f"every golden sample's package text is {texts[0]!r}: a bundle serving that constant would pass"]
    return []
