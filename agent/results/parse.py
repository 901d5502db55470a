"""Reading a result's JSON (a served compact result, a package answer, a vocabulary result) into a kind's
value, with errors that name the field: `top[2].score: a number wanted, found 'x'`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from agent.errors import BundleError


def result_type(result: Any, accepted: Sequence[str], kind: str) -> str:
    """The result's `type`, which must be one this kind reads."""
    if not isinstance(result, Mapping):
        raise BundleError(f"a {kind} result is a JSON object, found {type(result).__name__}")
    t = result.get("type")
    if t not in accepted:
        raise BundleError(f"field type: {t!r} is not a result this kind reads ({kind} reads "
                          f"{', '.join(repr(a) for a in accepted)})")
    return str(t)


def field(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise BundleError(f"field {where}{key}: missing")
    return obj[key]


def items(obj: Mapping[str, Any], key: str, where: str = "") -> list[Any]:
    v = field(obj, key, where)
    if not isinstance(v, list):
        raise BundleError(f"field {where}{key}: a list wanted, found {type(v).__name__}")
    return v


def mapping(v: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise BundleError(f"field {where}: an object wanted, found {type(v).__name__}")
    return v


def number(v: Any, where: str, allow_none: bool = False) -> float | None:
    """A finite number (None allowed where a served result writes a non-finite score as null)."""
    if type(v) is float or type(v) is int:  # the common case first: a result holds thousands of these
        if math.isfinite(v):
            return float(v)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise BundleError(f"field {where}: a finite number wanted, found {v!r}")
    return float(v)


def finite(v: Any, where: str) -> float:
    n = number(v, where)
    assert n is not None
    return n


def integer(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) or float(v) != int(v):
        raise BundleError(f"field {where}: a whole number wanted, found {v!r}")
    return int(v)


def text(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise BundleError(f"field {where}: a string wanted, found {v!r}")
    return v
