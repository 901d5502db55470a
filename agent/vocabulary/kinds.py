"""Result kinds as the manifest sees them: each kind's name, fields, options, default floors and the
vocabulary task it serves, declared once in its own module of `agent/results` and registered here.

The manifest's checks and the bundle schema's `postprocess.result` block, `task` enum and kind floors are
derived from these declarations, so a new kind is one module (plus its tests). The registry finds the kind
modules the way plugin hosts do (Frigate's detectors): by importing the packages named in `KIND_PACKAGES`
when first asked, so this floor's code never depends on a kind's code. Pure: no numpy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

DtypeClass = Literal["float", "int", "number", "mask"]
# the packages whose import registers the kinds (agent/results/__init__.py registers each of its modules)
KIND_PACKAGES: tuple[str, ...] = ("agent.results",)


@dataclass(frozen=True)
class Field:
    """One result tensor of one sample (no batch axis): its field name, whether a post stage must
    output it, the ranks it may have, and the dtype class of its values."""

    name: str
    required: bool
    ranks: tuple[int, ...]
    dtype: DtypeClass
    doc: str
    integral: bool = False  # values must be whole numbers (ids), whatever the dtype


@dataclass(frozen=True)
class Option:
    """A `postprocess.result` key a kind reads besides its fields: its JSON Schema, what it does, and,
    when the kind cannot serve without it, the reason given at load."""

    key: str
    schema: Mapping[str, Any]
    doc: str
    required: str | None = None  # why a bundle of this kind must state it (the load error's text)


@dataclass(frozen=True)
class Floor:
    """A fidelity floor the kind judges by (`selftest.fidelity.<key>`), a fraction in [0, 1]."""

    key: str
    default: float
    doc: str


@dataclass(frozen=True)
class KindDecl:
    name: str
    fields: tuple[Field, ...]
    options: tuple[Option, ...] = ()
    floors: tuple[Floor, ...] = ()
    vocabulary: str | None = None  # the vocabulary task (no post graph) that serves this kind
    doc: str = ""
    decoded: bool = False  # read from positions in a raw layout: a decoder building it must be proven by answers

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def option_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.options)

    @property
    def default_floors(self) -> dict[str, float]:
        return {f.key: f.default for f in self.floors}


@dataclass
class _Registry:
    kinds: dict[str, KindDecl] = field(default_factory=dict)
    generation: int = 0  # bumped at every change: what caches derived from the kinds key on
    loaded: bool = False


_REG = _Registry()


def register(decl: KindDecl) -> KindDecl:
    """Add a kind (a kind module's declaration); a second kind of one name is refused."""
    old = _REG.kinds.get(decl.name)
    if old is not None and old != decl:
        raise ValueError(f"result kind {decl.name!r} is declared twice")
    if old is None:
        _REG.kinds[decl.name] = decl
        _REG.generation += 1
    return decl


def unregister(name: str) -> None:
    """Remove a kind (a test's throwaway kind)."""
    if _REG.kinds.pop(name, None) is not None:
        _REG.generation += 1


def declared() -> Mapping[str, KindDecl]:
    """Every registered kind by name, in registration order."""
    if not _REG.loaded:
        _REG.loaded = True
        for package in KIND_PACKAGES:
            importlib.import_module(package)
    return dict(_REG.kinds)


def generation() -> int:
    declared()
    return _REG.generation


def declaration(name: str) -> KindDecl | None:
    return declared().get(name)


def vocabulary_kinds() -> dict[str, str]:
    """The vocabulary's tasks (no post graph) and the kind each serves."""
    return {d.vocabulary: d.name for d in declared().values() if d.vocabulary}


def owners(option: str) -> list[str]:
    """The kinds that read this `postprocess.result` option."""
    return [d.name for d in declared().values() if option in d.option_keys]


def option_keys() -> tuple[str, ...]:
    """Every option any kind reads: in a `postprocess.result` block, keys that are not field names."""
    seen: dict[str, None] = {}
    for d in declared().values():
        seen.update(dict.fromkeys(d.option_keys))
    return tuple(seen)


# -- the bundle schema's parts that the kinds declare ---------------------------------------------
def _joined(parts: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One property several kinds declare: one schema when they agree, else any of theirs."""
    schemas = [dict(s) for _, s in parts]
    out: dict[str, Any] = schemas[0] if all(s == schemas[0] for s in schemas) else {"anyOf": schemas}
    return out


def result_schema(description: str) -> dict[str, Any]:
    """`$defs/result`: `kind` and every kind's fields (the output name it takes) and options."""
    props: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    docs: dict[str, list[str]] = {}
    for d in declared().values():
        for f in d.fields:
            props.setdefault(f.name, []).append((d.name, {"type": "string"}))
            docs.setdefault(f.name, []).append(f"{d.name}: {f.doc}" + ("" if f.required else " (optional)"))
        for o in d.options:
            props.setdefault(o.key, []).append((d.name, o.schema))
            docs.setdefault(o.key, []).append(f"{d.name}: {o.doc}")
    properties: dict[str, Any] = {"kind": {"enum": list(declared())}}
    for key, parts in props.items():
        properties[key] = {**_joined(parts), "description": "; ".join(docs[key]) + "."}
    return {"type": "object", "additionalProperties": False, "required": ["kind"], "description": description,
            "properties": properties}


def floor_schema() -> dict[str, Any]:
    """The kinds' floors as `selftest.fidelity` properties."""
    out: dict[str, Any] = {}
    for d in declared().values():
        for f in d.floors:
            prev = out.get(f.key)
            text = f"{d.name}: {f.doc} (default {f.default:g})"
            out[f.key] = {"type": "number", "minimum": 0, "maximum": 1,
                          "description": text if prev is None else f"{prev['description']}; {text}"}
    return out


def task_names() -> list[str]:
    """`task`: the vocabulary's tasks, then the kinds (each with a post graph)."""
    return [*vocabulary_kinds(), *declared()]
