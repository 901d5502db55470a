"""A result kind's tensor fields: what a post stage must output, found by field name or by the name
`postprocess.result` gives it, and checked for presence, rank, dtype class, agreeing lengths and finiteness.

Pure over numpy. `setting` reads one key of the result spec, whether the caller holds it as a mapping
(the manifest's `postprocess.result` section) or as a dataclass.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from agent.vocabulary.kinds import DtypeClass, Field

__all__ = ["DtypeClass", "Field"]  # declared on the vocabulary floor (agent/vocabulary/kinds.py), used here

_KINDS: dict[DtypeClass, str] = {"float": "f", "int": "iub", "number": "fiub", "mask": "fiub"}


def setting(spec: Any, key: str, default: Any = None) -> Any:
    """One key of the result spec (a mapping, a dataclass, or None)."""
    if spec is None:
        return default
    if isinstance(spec, Mapping):
        value = spec.get(key, default)
    else:
        value = getattr(spec, key, default)
    return default if value is None else value


def output_name(spec: Any, f: Field) -> str:
    """The graph output that carries field `f`: named by `postprocess.result.<field>`, else the field's name."""
    name = setting(spec, f.name)
    return name if isinstance(name, str) and name else f.name


def field_tensors(tensors: Mapping[str, np.ndarray], spec: Any, fields: Sequence[Field]) -> dict[str, np.ndarray]:
    """The present fields by field name. A tensor is found under its declared output name or its field
    name; a leading batch axis of one (rank one over the field's) is dropped."""
    out: dict[str, np.ndarray] = {}
    for f in fields:
        name = output_name(spec, f)
        if name in tensors:
            a = np.asarray(tensors[name])
        elif f.name in tensors:
            a = np.asarray(tensors[f.name])
        else:
            continue
        if a.ndim == max(f.ranks) + 1 and a.shape[0] == 1:
            a = a[0]
        out[f.name] = a
    return out


def check_fields(tensors: Mapping[str, np.ndarray], spec: Any, fields: Sequence[Field], kind: str) -> list[str]:
    """Missing required fields, wrong ranks, wrong dtype classes, non-whole ids and non-finite floats."""
    problems: list[str] = []
    found = field_tensors(tensors, spec, fields)
    for f in fields:
        where = f"result {kind} field {f.name!r} (output {output_name(spec, f)!r})"
        if f.name not in found:
            if f.required:
                problems.append(f"{where} is missing: the post stage outputs {sorted(tensors)}")
            continue
        a = found[f.name]
        if a.ndim not in f.ranks:
            ranks = " or ".join(str(r) for r in f.ranks)
            problems.append(f"{where} has shape {list(a.shape)}: rank {ranks} wanted ({f.doc})")
            continue
        if a.dtype.kind not in _KINDS[f.dtype]:
            problems.append(f"{where} has dtype {a.dtype}: {f.dtype} values wanted ({f.doc})")
            continue
        if a.dtype.kind == "f":
            bad = int(np.count_nonzero(~np.isfinite(a)))
            if bad:
                problems.append(f"{where}: {bad} of {a.size} values are not finite")
                continue
        if f.integral and a.dtype.kind == "f" and a.size and not np.all(a == np.round(a)):
            problems.append(f"{where}: ids must be whole numbers, found {a[a != np.round(a)].ravel()[0]:g}")
    return problems


def lengths_agree(found: Mapping[str, np.ndarray], names: Sequence[str], kind: str) -> list[str]:
    """Fields that must have one row per item (boxes, tokens) and do not."""
    present = [(n, found[n].shape[0]) for n in names if n in found and found[n].ndim >= 1]
    if len({n for _, n in present}) <= 1:
        return []
    return [f"result {kind}: fields disagree on the number of items: "
            + ", ".join(f"{name} has {n}" for name, n in present)]


def rounded(v: float, digits: int) -> float | None:
    """A JSON-safe number: rounded, or None when not finite."""
    v = float(v)
    return round(v, digits) if math.isfinite(v) else None


def label_of(labels: Sequence[str], i: int) -> str:
    return labels[i] if 0 <= i < len(labels) else str(i)
