"""Recipe parameters: each recipe declares its own (type, default, meaning); `--param key=value` is parsed here.

Errors name the recipe and the key, and say what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import UsageError


@dataclass(frozen=True)
class Param:
    """One recipe parameter. kind: int, float, bool, str, floats (comma list), ints, int_lists ("16,32;64,128"),
    float_lists ("2;2,3")."""

    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # every number given (of a list too) at least this

    def parse(self, recipe: str, key: str, value: Any) -> Any:
        where = f"recipe {recipe}: --param {key}"
        try:
            if self.kind == "int":
                out: Any = int(value)
            elif self.kind == "float":
                out = float(value)
            elif self.kind == "bool":
                if isinstance(value, bool):
                    out = value
                elif str(value).lower() in ("1", "true", "yes", "on"):
                    out = True
                elif str(value).lower() in ("0", "false", "no", "off"):
                    out = False
                else:
                    raise ValueError(value)
            elif self.kind == "str":
                out = str(value)
            elif self.kind in ("floats", "ints"):
                conv = float if self.kind == "floats" else int
                items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
                out = tuple(conv(v) for v in items)
            elif self.kind in ("int_lists", "float_lists"):
                conv = int if self.kind == "int_lists" else float
                groups = value if isinstance(value, (list, tuple)) else \
                    [[v for v in g.split(",") if v.strip()] for g in str(value).split(";")]
                out = tuple(tuple(conv(v) for v in g) for g in groups)
            else:  # pragma: no cover - a recipe's own declaration
                raise AssertionError(self.kind)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{where}: expected {_expected(self.kind)}, found {value!r}") from exc
        if self.choices and out not in self.choices:
            raise UsageError(f"{where}: expected one of {', '.join(self.choices)}, found {value!r}")
        if self.minimum is not None:
            numbers = [out] if isinstance(out, (int, float)) else [v for g in out for v in (g if isinstance(g, tuple) else (g,))]
            low = [v for v in numbers if v < self.minimum]
            if low:
                raise UsageError(f"{where}: expected values >= {self.minimum:g}, found {low[0]:g} in {value!r}")
        return out


def _expected(kind: str) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "floats": "numbers separated by commas", "ints": "integers separated by commas",
            "int_lists": "integer lists separated by ';' (e.g. 16,32;64,128)",
            "float_lists": "number lists separated by ';' (e.g. 2;2,3)"}[kind]


def split_params(items: Sequence[str]) -> dict[str, str]:
    """`key=value` strings (the CLI's repeated --param) -> a dict; a key given twice is refused."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--param {item!r}: expected KEY=VALUE")
        if key in out:
            raise UsageError(f"--param {key} given twice")
        out[key] = value.strip()
    return out


def resolve(recipe: str, declared: Mapping[str, Param], given: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with the given values, each parsed; an unknown key names the ones the recipe takes."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise UsageError(f"recipe {recipe}: unknown --param {', '.join(unknown)} (it takes: {', '.join(sorted(declared))})")
    out = {k: p.default for k, p in declared.items()}
    for k, v in given.items():
        out[k] = declared[k].parse(recipe, k, v)
    return out


def describe(p: dict[str, Any]) -> str:
    """A recipe's parameters as the graph's doc string records them: `k=v, ...` in key order."""
    return ", ".join(f"{k}={v}" for k, v in sorted(p.items()))
