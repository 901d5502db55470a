"""What the page shows, pulled out of a self-test report: pure functions over plain JSON values.

The report's schema grows (per-sample reproduction and fidelity sections, new bounds), so metrics are
found generically: any value with a bound beside it, any per-sample list, any `sample`/`stage` named in
a reason. A new section appears on the page without a code change here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# Sections of a candidate that have their own place on the page.
KNOWN_SECTIONS = {"provider", "variant", "precision", "options", "status", "passed", "reasons",
                  "effective_providers", "placement", "latency", "latency_context", "create_ms", "error",
                  "findings", "warnings"}
_BOUND_KEYS = ("bound", "threshold", "max", "min", "limit", "floor", "ceiling", "upper", "lower")
_VALUE_KEYS = ("value", "measured", "got", "abs_diff")
_SAMPLE_KEYS = ("sample", "index", "sample_index", "id")
_SAMPLE_LISTS = ("samples", "per_sample", "by_sample")
# Metrics where more is better when nothing else says which side of the bound is the good one.
_HIGHER_IS_BETTER = ("cosine", "agreement", "recall", "precision", "iou", "accuracy", "top1", "topk", "map",
                     "f1", "psnr", "snr", "dice", "similarity", "overlap", "score")
_SAMPLE_RE = re.compile(r"\bsamples? (\d+)")
_STAGE_RE = re.compile(r"\bat stage (\w+)")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


@dataclass(frozen=True)
class Bound:
    value: float
    op: str  # "<=" (value must not exceed) or ">=" (value must reach)

    def holds(self, v: float | None) -> bool:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return False
        return v <= self.value if self.op == "<=" else v >= self.value

    def __str__(self) -> str:
        return f"{self.op} {fmt(self.value)}"


@dataclass(frozen=True)
class Metric:
    """One measured value, its bound when the report gives one, and whether it held."""

    section: str
    name: str
    value: float | None
    bound: Bound | None = None
    passed: bool | None = None  # None: no bound, nothing to judge
    sample: int | None = None
    stage: str | None = None


@dataclass
class SampleView:
    """Everything the page knows about one golden sample for one candidate."""

    sample: int
    metrics: list[Metric] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    stages: set[str] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return bool(self.reasons) or any(m.passed is False for m in self.metrics)


def fmt(v: Any) -> str:
    """Numbers as people read them: 4 significant digits, no float noise."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _direction(name: str, bound_key: str | None, entry: Mapping[str, Any]) -> str:
    op = entry.get("op") or entry.get("direction") or entry.get("comparison")
    if isinstance(op, str):
        if op.strip() in ("<=", "<", "max", "le", "lt", "upper", "at_most"):
            return "<="
        if op.strip() in (">=", ">", "min", "ge", "gt", "lower", "at_least"):
            return ">="
    if bound_key in ("max", "ceiling", "upper"):
        return "<="
    if bound_key in ("min", "floor", "lower"):
        return ">="
    n = name.lower()
    if n.startswith("min_"):
        return ">="
    if n.startswith("max_"):
        return "<="
    return ">=" if any(w in n for w in _HIGHER_IS_BETTER) else "<="


def _named_bound(name: str, bounds: Mapping[str, Any]) -> Bound | None:
    """The bound for `name` in a section's bounds: under its own name, or as min_<name> / max_<name>."""
    if name in bounds:
        return _bound_from(name, bounds[name])
    for prefix, op in (("min_", ">="), ("max_", "<=")):
        spec = bounds.get(prefix + name)
        b = _bound_from(prefix + name, spec)
        if b is not None:
            return Bound(b.value, op)
    return None


def _bound_from(name: str, spec: Any) -> Bound | None:
    """A bound given as a number, or as a mapping with one of the bound keys (and maybe an op)."""
    if _num(spec) is not None:
        return Bound(float(spec), _direction(name, None, {}))
    if isinstance(spec, Mapping):
        for k in _BOUND_KEYS:
            if _num(spec.get(k)) is not None:
                return Bound(float(spec[k]), _direction(name, k, spec))
    return None


def _metric(section: str, name: str, raw: Any, bounds: Mapping[str, Any], sample: int | None,
            stage: str | None) -> Metric | None:
    """`raw` is a number (bound from `bounds`) or a mapping {value, bound|max|min, op?, passed?, stage?}."""
    if isinstance(raw, Mapping):
        value = next((_num(raw[k]) for k in _VALUE_KEYS if _num(raw.get(k)) is not None), None)
        if value is None and not any(k in raw for k in _VALUE_KEYS):
            return None
        bound = _bound_from(name, raw) or _named_bound(name, bounds)
        explicit = next((raw[k] for k in ("passed", "ok", "pass") if isinstance(raw.get(k), bool)), None)
        st = raw.get("stage") if isinstance(raw.get("stage"), str) else stage
        smp = next((int(raw[k]) for k in _SAMPLE_KEYS if _num(raw.get(k)) is not None), sample)
    else:
        value = _num(raw)
        if value is None:
            return None
        bound, explicit, st, smp = _named_bound(name, bounds), None, stage, sample
    passed = explicit if explicit is not None else (None if bound is None else bound.holds(value))
    return Metric(section, name, value, bound, passed, smp, st)


def _bounds_of(d: Mapping[str, Any]) -> Mapping[str, Any]:
    for k in ("bounds", "thresholds", "limits"):
        if isinstance(d.get(k), Mapping):
            return d[k]
    return {}


def _entries(section: str, d: Mapping[str, Any], inherited: Mapping[str, Any]) -> Iterable[Metric]:
    bounds = {**inherited, **_bounds_of(d)}
    stage = d.get("stage") if isinstance(d.get("stage"), str) else None
    for name, raw in d.items():
        if name in ("bounds", "thresholds", "limits", "stage") or (
                name not in _SAMPLE_LISTS and (name.endswith("sample") or name in _SAMPLE_KEYS)):
            continue
        if name in _SAMPLE_LISTS and isinstance(raw, list):
            for i, entry in enumerate(raw):
                if not isinstance(entry, Mapping):
                    continue
                smp = next((int(entry[k]) for k in _SAMPLE_KEYS if _num(entry.get(k)) is not None), i)
                st = entry.get("stage") if isinstance(entry.get("stage"), str) else stage
                for mname, mraw in entry.items():
                    if mname in _SAMPLE_KEYS or mname in ("stage", "passed", "ok", "file", "reasons"):
                        continue
                    m = _metric(section, mname, mraw, {**bounds, **_bounds_of(entry)}, smp, st)
                    if m is not None:
                        yield m
                if entry.get("passed") is False or entry.get("ok") is False:
                    yield Metric(section, "passed", None, None, False, smp, st)
            continue
        if isinstance(raw, Mapping) and isinstance(raw.get("values"), list):
            b = _bound_from(name, raw) or _named_bound(name, bounds)
            for i, v in enumerate(raw["values"]):
                m = _metric(section, name, v, {name: b.value} if b else {}, i, stage)
                if m is not None:
                    yield Metric(m.section, m.name, m.value, b or m.bound, m.passed if b is None else b.holds(m.value),
                                 m.sample, m.stage)
            continue
        m = _metric(section, name, raw, bounds, None, stage)
        if m is not None:
            yield m
        elif isinstance(raw, Mapping):
            yield from _entries(f"{section}.{name}", raw, bounds)


def finding_metrics(c: Mapping[str, Any]) -> list[Metric]:
    """The verdict's own findings ({check, metric, value, bound, sample, stage, text}): each broke its bound."""
    out = []
    found = c.get("findings")
    for f in found if isinstance(found, list) else ():  # a damaged report may hold anything here
        if not isinstance(f, Mapping):
            continue
        text = str(f.get("text") or "")
        op = "<=" if " over " in text else ">=" if " under " in text else _direction(str(f.get("metric", "")), None, f)
        bound = Bound(float(f["bound"]), op) if _num(f.get("bound")) is not None else None
        out.append(Metric(str(f.get("check") or "finding"), str(f.get("metric") or "?"), _num(f.get("value")), bound,
                          False, int(f["sample"]) if _num(f.get("sample")) is not None else None,
                          f.get("stage") if isinstance(f.get("stage"), str) else None))
    return out


def candidate_metrics(c: Mapping[str, Any], extra_bounds: Mapping[str, Mapping[str, Any]] | None = None) -> list[Metric]:
    """Every metric in a candidate's sections other than the ones with their own place on the page.

    `extra_bounds` (section -> metric -> bound) fills in bounds the report itself does not carry, e.g. the
    thresholds in the bundle's manifest for today's `parity` summary."""
    out: list[Metric] = finding_metrics(c)
    for section, d in c.items():
        if section in KNOWN_SECTIONS or not isinstance(d, Mapping):
            continue
        out.extend(_entries(section, d, (extra_bounds or {}).get(section, {})))
    return out


def reason_samples(reasons: Iterable[str]) -> dict[int, list[tuple[str, str | None]]]:
    """sample -> [(reason, stage)] for each reason that names a sample."""
    out: dict[int, list[tuple[str, str | None]]] = {}
    for r in reasons:
        stage = _STAGE_RE.search(r)
        for m in _SAMPLE_RE.finditer(r):
            out.setdefault(int(m.group(1)), []).append((r, stage.group(1) if stage else None))
    return out


def sample_views(c: Mapping[str, Any], metrics: list[Metric]) -> dict[int, SampleView]:
    """Per golden sample: its metrics, the reasons that name it and the stages they blame."""
    views: dict[int, SampleView] = {}
    for m in metrics:
        if m.sample is None:
            continue
        v = views.setdefault(m.sample, SampleView(m.sample))
        v.metrics.append(m)
        if m.passed is False and m.stage:
            v.stages.add(m.stage)
    reasons = c.get("reasons")
    for sample, items in reason_samples([str(r) for r in reasons] if isinstance(reasons, list) else []).items():
        v = views.setdefault(sample, SampleView(sample))
        for reason, stage in items:
            v.reasons.append(reason)
            if stage:
                v.stages.add(stage)
    pre = c.get("preprocess") if isinstance(c.get("preprocess"), Mapping) else None
    if pre and _num(pre.get("worst_sample")) is not None and (_num(pre.get("max_abs")) or 0) > 0:
        v = views.setdefault(int(pre["worst_sample"]), SampleView(int(pre["worst_sample"])))
        if not any(m.section == "preprocess" and m.name == "max_abs" for m in v.metrics):
            v.metrics.append(Metric("preprocess", "max_abs (worst sample)", float(pre["max_abs"]), sample=v.sample,
                                    stage="preprocessing"))
    return dict(sorted(views.items()))


def manifest_bounds(selftest: Mapping[str, Any] | None, precision: str | None) -> dict[str, dict[str, Any]]:
    """Today's `parity` summary carries no bounds: take them from the bundle manifest's `selftest`."""
    if not selftest:
        return {}
    out: dict[str, dict[str, Any]] = {}
    parity = selftest.get("parity")
    parity = parity.get(precision or "") if isinstance(parity, Mapping) else None
    parity = parity if isinstance(parity, Mapping) else {}
    rename = {"max_abs": "max_abs", "max_rel": "max_rel", "min_cosine": "min_cosine",
              "min_top1_agreement": "top1_agreement", "min_topk_agreement": "topk_agreement",
              "min_recall": "recall", "min_precision": "precision"}
    for key, metric in rename.items():
        if _num(parity.get(key)) is not None:
            op = ">=" if key.startswith("min_") else "<="
            out.setdefault("parity", {})[metric] = {"bound": parity[key], "op": op}
    if _num(selftest.get("preprocess_max_abs")) is not None:
        out["preprocess"] = {"max_abs": {"bound": selftest["preprocess_max_abs"], "op": "<="}}
    return out
