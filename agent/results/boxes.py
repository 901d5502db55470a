"""Result kind `boxes`: boxes (xyxy, frame pixels) with scores, optional class ids and keypoints per box.

Judged per sample against the package's own boxes, matched one to one (same class, greedy by IoU at
`match_iou`): recall and precision, localisation as the matched-IoU distribution (median floored; p10
and min reported), score differences of matches, and keypoint error normalised by the box diagonal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError, ResultTooLargeError
from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, label_of, lengths_agree, setting
from agent.vocabulary.kinds import Floor, Option
from agent.results.floors import (
    Figures, count_mismatch, json_figures, merge_floors, over, read_pairs, sample_list, under,
)
from agent.vocabulary.decoders import iou

NAME = "boxes"
FIELDS: tuple[Field, ...] = (
    Field("boxes", True, (2,), "number", "[N, 4] x1, y1, x2, y2 in frame pixels"),
    Field("scores", True, (1,), "float", "[N] score per box"),
    Field("class_ids", False, (1,), "number", "[N] class id per box", integral=True),
    Field("keypoints", False, (3,), "number", "[N, K, 2] or [N, K, 3] x, y (, visibility or score) in frame pixels"),
)
FLOORS: tuple[Floor, ...] = (
    Floor("match_iou", 0.5, "a served box matches a package box of its class at this IoU or more"),
    Floor("min_recall", 0.9, "share of the package's boxes matched"),
    Floor("min_precision", 0.9, "share of the served boxes matched"),
    Floor("min_median_iou", 0.85, "floor of the matched boxes' median IoU"),
    Floor("score_tolerance", 0.02, "|served score - package score| of matched boxes allowed"),
    Floor("max_keypoint_error", 0.05, "keypoint distance over the package box's diagonal allowed"),
)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
# values read from positions in a raw layout: a decoder building it needs the package's answers to be proven
DECODED = True
READS: tuple[str, ...] = ("boxes", "detection")
MIN_BOX_BYTES = 56  # the JSON of the smallest box entry is longer: {"box":[0.0,0.0,0.0,0.0],"score":0.0,...}
# postprocess.result keys this kind reads besides its fields (and `kind`)
OPTIONS: tuple[Option, ...] = (
    Option("score_threshold", {"type": "number"},
           "rows scoring under it are no box (a padded fixed-size output); default: every row"),
    Option("max_detections", {"type": "integer", "minimum": 1}, "at most this many boxes, best first; default: all"),
)


@dataclass(frozen=True)
class Box:
    box: tuple[float, float, float, float]
    score: float | None
    class_id: int
    label: str
    keypoints: tuple[tuple[float, ...], ...] | None = None  # (x, y) or (x, y, v) per keypoint

    @property
    def diagonal(self) -> float:
        return math.hypot(self.box[2] - self.box[0], self.box[3] - self.box[1])


@dataclass(frozen=True)
class Boxes:
    boxes: tuple[Box, ...]


# ---------------------------------------------------------------- tensors

def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    problems = check_fields(tensors, spec, FIELDS, NAME)
    found = field_tensors(tensors, spec, FIELDS)
    if problems:
        return problems
    b = found["boxes"]
    if b.shape[1] != 4:
        problems.append(f"result {NAME} field 'boxes' has shape {list(b.shape)}: [N, 4] xyxy wanted")
    k = found.get("keypoints")
    if k is not None and k.shape[2] not in (2, 3):
        problems.append(f"result {NAME} field 'keypoints' has shape {list(k.shape)}: [N, K, 2 or 3] wanted")
    problems += lengths_agree(found, [f.name for f in FIELDS], NAME)
    if not problems and b.size:
        inverted = int(np.count_nonzero((b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1])))
        if inverted:
            problems.append(f"result {NAME} field 'boxes': {inverted} of {len(b)} boxes have x2 < x1 or y2 < y1 "
                            "(xyxy wanted: a cxcywh or xywh box served as xyxy?)")
    return problems


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    """Best score first; rows under `score_threshold` (a padded fixed-size output) and rows with a
    non-finite box or score are no box; at most `max_detections`."""
    found = field_tensors(tensors, spec, FIELDS)
    b = np.asarray(found["boxes"], dtype=np.float64).reshape(-1, 4)
    s = np.asarray(found["scores"], dtype=np.float64).reshape(-1)
    c = found.get("class_ids")
    cls = np.zeros(len(b), np.int64) if c is None else np.nan_to_num(np.asarray(c, np.float64)).astype(np.int64)
    kp = found.get("keypoints")
    keep = np.isfinite(s) & np.isfinite(b).all(axis=1)
    if kp is not None:  # every value of a box's keypoints finite (all() over [K, 2 or 3]: reshape fails on N = 0)
        k = np.asarray(kp, np.float64)
        keep &= np.isfinite(k).all(axis=tuple(range(1, k.ndim)))
    threshold = setting(spec, "score_threshold")
    if threshold is not None:
        keep &= s >= float(threshold)
    idx = np.flatnonzero(keep)
    idx = idx[np.argsort(-s[idx], kind="stable")]
    cap = setting(spec, "max_detections")
    if cap is not None:
        idx = idx[: int(cap)]
    max_bytes = int(setting(spec, "max_result_bytes", 0))  # the engine's output.max_result_bytes, when it has one
    if max_bytes > 0 and len(idx) * MIN_BOX_BYTES > max_bytes:  # never build a result it must drop (200k rows: 7 s)
        raise ResultTooLargeError(f"{NAME} result of {len(idx)} boxes is at least {len(idx) * MIN_BOX_BYTES} bytes, over "
                                  f"output.max_result_bytes = {max_bytes}: declare postprocess.result.score_threshold "
                                  "or max_detections, or raise the cap")
    out = []
    for i in idx:
        entry: dict[str, Any] = {"box": [round(float(v), 2) for v in b[i]], "score": round(float(s[i]), 6),
                                 "class_id": int(cls[i]), "label": label_of(labels, int(cls[i]))}
        if kp is not None:
            entry["keypoints"] = [[round(float(v), 2 if j < 2 else 6) for j, v in enumerate(p)]
                                  for p in np.asarray(kp[i], np.float64)]
        out.append(entry)
    return {"type": NAME, "boxes": out}


# ---------------------------------------------------------------- values

def normalise(result: Mapping[str, Any]) -> Boxes:
    """A `boxes` result or the vocabulary's `detection` result (`detections`, no keypoints)."""
    t = parse.result_type(result, READS, NAME)
    key = "boxes" if t == "boxes" else "detections"
    out = []
    for i, entry in enumerate(parse.items(result, key)):
        where = f"{key}[{i}]."
        e = parse.mapping(entry, f"{key}[{i}]")
        raw_box = parse.field(e, "box", where)
        if not isinstance(raw_box, list) or len(raw_box) != 4:
            raise BundleError(f"field {where}box: [x1, y1, x2, y2] wanted, found {raw_box!r}")
        x1, y1, x2, y2 = (parse.finite(v, f"{where}box[{j}]") for j, v in enumerate(raw_box))
        if x2 < x1 or y2 < y1:
            raise BundleError(f"field {where}box: {raw_box} has x2 < x1 or y2 < y1 (xyxy wanted)")
        cid = parse.integer(e.get("class_id", 0), where + "class_id")
        label = e.get("label")
        kps = None
        if e.get("keypoints") is not None:
            kps = tuple(_keypoint(p, f"{where}keypoints[{j}]") for j, p in enumerate(parse.items(e, "keypoints")))
        out.append(Box((x1, y1, x2, y2), parse.number(parse.field(e, "score", where), where + "score", True),
                       cid, str(cid) if label is None else parse.text(label, where + "label"), kps))
    return Boxes(tuple(out))


def _keypoint(p: Any, where: str) -> tuple[float, ...]:
    if not isinstance(p, list) or len(p) not in (2, 3):
        raise BundleError(f"field {where}: [x, y] or [x, y, v] wanted, found {p!r}")
    if all(type(v) is float for v in p) and all(map(math.isfinite, p)):
        return tuple(p)
    return tuple(parse.finite(v, f"{where}[{j}]") for j, v in enumerate(p))


# ---------------------------------------------------------------- fidelity

def match(served: Sequence[Box], package: Sequence[Box], min_iou: float) -> list[tuple[int, int, float]]:
    """One-to-one (package index, served index, IoU): same class only, greedy by IoU, at min_iou or more."""
    if not served or not package:
        return []
    m = iou(np.asarray([b.box for b in package], np.float64), np.asarray([b.box for b in served], np.float64))
    same = np.asarray([p.class_id for p in package])[:, None] == np.asarray([s.class_id for s in served])[None, :]
    m = np.where(same, m, -1.0)
    pairs = [(float(m[a, s]), a, s) for a, s in zip(*np.nonzero(m >= min_iou))]
    pairs.sort(key=lambda t: (-t[0], t[1], t[2]))
    used_a: set[int] = set()
    used_s: set[int] = set()
    out = []
    for v, a, s in pairs:
        if a in used_a or s in used_s:
            continue
        used_a.add(a)
        used_s.add(s)
        out.append((int(a), int(s), v))
    return out


@dataclass(frozen=True)
class _Sample:
    index: int
    package: int
    served: int
    matched: int


def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    """Figures: recall, precision (pooled over all samples), matched, package_boxes, served_boxes,
    median_iou, p10_iou, min_iou (of matched boxes), max_score_diff, scores_over_tolerance,
    max_keypoint_error, keypoints_judged, keypoints_over_floor, worst_sample (the lowest
    min(recall, precision) of one sample, ties to the lowest matched IoU)."""
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None}, [mismatch]
    samples: list[_Sample] = []
    ious: list[tuple[float, int, str]] = []  # (IoU, sample, which)
    score_diffs: list[tuple[float, int, str]] = []
    kp_errors: list[tuple[float, int, str]] = []
    kp_findings: list[Finding] = []
    values, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    for i, s_value, a_value in values:
        got, want = s_value.boxes, a_value.boxes
        pairs = match(got, want, f["match_iou"])
        samples.append(_Sample(i, len(want), len(got), len(pairs)))
        for a, s, v in pairs:
            pa, ps = want[a], got[s]
            which = f"package box {a} (class {pa.class_id}) and served box {s}"
            ious.append((v, i, which))
            if pa.score is not None:
                d = float("inf") if ps.score is None else abs(ps.score - pa.score)
                score_diffs.append((d, i, f"{which}: served score {ps.score}, package {pa.score:.6g}"))
            kp_findings += _keypoint_errors(pa, ps, i, a, kp_errors, stage)
    figures, findings = _judge(samples, ious, score_diffs, kp_errors, kp_findings, f, stage)
    return figures, unreadable + findings


def _keypoint_errors(pa: Box, ps: Box, sample: int, a: int, errors: list[tuple[float, int, str]],
                     stage: str) -> list[Finding]:
    if pa.keypoints is None:
        return []
    if ps.keypoints is None or len(ps.keypoints) != len(pa.keypoints):
        n = 0 if ps.keypoints is None else len(ps.keypoints)
        return [Finding("fidelity", "keypoints per matched box", float(n), float(len(pa.keypoints)), stage, sample,
                        f"package box {a} has {len(pa.keypoints)} keypoints, the served box {n}", "under")]
    diag = max(pa.diagonal, 1e-9)
    for k, (p, q) in enumerate(zip(pa.keypoints, ps.keypoints)):
        dist = math.hypot(q[0] - p[0], q[1] - p[1])
        errors.append((dist / diag, sample, f"package box {a} keypoint {k}: {dist:.3g} px off on a box of "
                                            f"diagonal {diag:.4g} px"))
    return []


def _judge(samples: list[_Sample], ious: list[tuple[float, int, str]], score_diffs: list[tuple[float, int, str]],
           kp_errors: list[tuple[float, int, str]], kp_findings: list[Finding], f: Mapping[str, float],
           stage: str) -> tuple[Figures, list[Finding]]:
    n_pkg = sum(s.package for s in samples)
    n_srv = sum(s.served for s in samples)
    matched = sum(s.matched for s in samples)
    recall = matched / n_pkg if n_pkg else 1.0
    precision = matched / n_srv if n_srv else (1.0 if n_pkg == 0 else 0.0)
    v = np.asarray([x[0] for x in ious], np.float64)
    tol, kp_floor = f["score_tolerance"], f["max_keypoint_error"]
    scores_over = [d for d in score_diffs if d[0] > tol]
    kp_over = [e for e in kp_errors if e[0] > kp_floor]
    worst_iou = min(ious, default=None)
    worst_score = max(score_diffs, default=None)
    worst_kp = max(kp_errors, default=None)

    def own(s: _Sample) -> tuple[float, float]:
        r = s.matched / s.package if s.package else 1.0
        p = s.matched / s.served if s.served else 1.0
        return r, p

    def sample_min_iou(i: int) -> float:
        return min((x[0] for x in ious if x[1] == i), default=1.0)

    worst = min(samples, key=lambda s: (min(own(s)), sample_min_iou(s.index)), default=None)
    figures: Figures = {
        "recall": recall, "precision": precision, "matched": matched, "package_boxes": n_pkg,
        "served_boxes": n_srv,
        "median_iou": float(np.median(v)) if v.size else None,
        "p10_iou": float(np.percentile(v, 10)) if v.size else None,
        "min_iou": float(v.min()) if v.size else None,
        "max_score_diff": worst_score[0] if worst_score else None,
        "scores_over_tolerance": len(scores_over),
        "max_keypoint_error": worst_kp[0] if worst_kp else None,
        "keypoints_judged": len(kp_errors), "keypoints_over_floor": len(kp_over),
        "worst_sample": worst.index if worst is not None and (min(own(worst)) < 1.0 or ious) else None,
    }
    findings: list[Finding] = []
    n = len(samples)
    if recall < f["min_recall"]:
        s = min(samples, key=lambda s: (own(s)[0], -(s.package - s.matched)))
        missed = [x.index for x in samples if x.matched < x.package]
        findings.append(under(f"recall (pooled over {n} samples)", recall, f["min_recall"], stage, s.index,
                              f"{matched} of {n_pkg} package boxes matched at IoU {f['match_iou']:g}; sample "
                              f"{s.index} alone: {s.matched} of {s.package} (recall {own(s)[0]:.4g}); samples "
                              f"missing boxes: {sample_list(missed)}"))
    if precision < f["min_precision"]:
        s = min(samples, key=lambda s: (own(s)[1], -(s.served - s.matched)))
        extra = [x.index for x in samples if x.matched < x.served]
        findings.append(under(f"precision (pooled over {n} samples)", precision, f["min_precision"], stage, s.index,
                              f"{matched} of {n_srv} served boxes match a package box; sample {s.index} alone: "
                              f"{s.matched} of {s.served} (precision {own(s)[1]:.4g}); samples with unmatched "
                              f"boxes: {sample_list(extra)}"))
    if v.size and float(np.median(v)) < f["min_median_iou"] and worst_iou is not None:
        findings.append(under(f"median IoU of matched boxes (pooled over {v.size} matches)", float(np.median(v)),
                              f["min_median_iou"], stage, worst_iou[1],
                              f"lowest match: IoU {worst_iou[0]:.4g} on sample {worst_iou[1]}, {worst_iou[2]}; "
                              f"p10 {np.percentile(v, 10):.4g}"))
    if worst_score is not None and scores_over:
        findings.append(over("|score - package score| of a matched box", worst_score[0], tol, stage, worst_score[1],
                             f"{worst_score[2]}; {len(scores_over)} of {len(score_diffs)} matches over the "
                             "tolerance"))
    if worst_kp is not None and kp_over:
        findings.append(over("keypoint error / box diagonal", worst_kp[0], kp_floor, stage, worst_kp[1],
                             f"{worst_kp[2]}; {len(kp_over)} of {len(kp_errors)} keypoints over the floor"))
    if kp_findings:  # the first, with the count: one is enough to say the served boxes lack the keypoints
        k = kp_findings[0]
        findings.append(Finding(k.check, k.metric, k.value, k.bound, k.stage, k.sample,
                                f"{k.detail}; {len(kp_findings)} matched boxes so", k.comparison))
    return json_figures(figures), findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    """No package box at all: recall cannot fail; no matched box can judge localisation either."""
    values = [normalise(a) for a in answers]
    if values and not any(v.boxes for v in values):
        return ["no golden sample has a package box: recall and localisation cannot fail on this set "
                "(only precision judges it); add frames with objects"]
    out = []
    with_kp = sum(1 for v in values for b in v.boxes if b.keypoints)
    total = sum(len(v.boxes) for v in values)
    if 0 < with_kp < total:
        out.append(f"{with_kp} of {total} package boxes carry keypoints: keypoints are judged only where the "
                   "package gave them")
    return out
