"""`postprocess.result`: the result kind a bundle serves, the graph output of each of its fields and the
kind's options, read and checked against the kind's declaration (agent/vocabulary/kinds.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from agent.errors import BundleError
from agent.vocabulary import kinds


@dataclass(frozen=True)
class ResultSpec:
    """`postprocess.result`: the result kind served, which graph output holds each of its fields, and the
    kind's options (agent/vocabulary/kinds.py declares which keys are fields and which options)."""

    kind: str
    fields: Mapping[str, str] = field(default_factory=dict)  # kind field -> graph output name
    options: Mapping[str, Any] = field(default_factory=dict)  # as stated; each kind reads its own defaults

    def output_for(self, field_name: str) -> str:
        return self.fields.get(field_name, field_name)

    def option(self, key: str, default: Any = None) -> Any:
        value = self.options.get(key)
        return default if value is None else value

    @property
    def charset(self) -> str | None:
        """The charset file (kind text), a bundle file the loader hashes and reads."""
        value = self.option("charset")
        return None if value is None else str(value)

    def as_mapping(self) -> dict[str, Any]:
        """The block as the manifest states it (field -> output name, `kind`, the options): what agent.results reads."""
        return {**self.fields, "kind": self.kind, **self.options}


def result_from_dict(d: Mapping[str, Any]) -> ResultSpec:
    """Options are the keys some kind declares as one (checked against this kind's by the manifest's checks);
    the rest are fields."""
    options = set(kinds.option_keys())
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in options}
    fields = {k: v for k, v in d.items() if k not in options and k != "kind"}
    return ResultSpec(kind=str(d.get("kind", "")), fields=fields, options=opts)


def check_result(r: ResultSpec, task: str, graph: bool, where: str) -> None:
    """`postprocess.result` against its kind's declaration: fields, options, the vocabulary's task (`task`,
    and whether a post graph serves it)."""
    decl = kinds.declaration(r.kind)
    if decl is None:
        raise BundleError(f"{where}: key postprocess.result.kind: unknown result kind {r.kind!r} "
                          f"(known: {', '.join(sorted(kinds.declared()))})")
    vocabulary_kind = kinds.vocabulary_kinds()
    if not graph and task in vocabulary_kind and vocabulary_kind[task] != r.kind:
        raise BundleError(f"{where}: key postprocess.result.kind: the vocabulary's {task} serves kind "
                          f"{vocabulary_kind[task]}, not {r.kind}")
    if not graph and task in kinds.declared():
        raise BundleError(f"{where}: key task: {task!r} is a result kind: it needs postprocess.graph (the "
                          f"vocabulary's tasks are {', '.join(vocabulary_kind)})")
    known = list(decl.field_names)
    for key in r.fields:
        if key not in known:
            raise BundleError(f"{where}: key postprocess.result.{key}: not a field of kind {r.kind} (fields: {known})")
    if graph:  # a field not named is the graph output of the field's own name
        names = [r.output_for(f.name) for f in decl.fields if f.required or f.name in r.fields]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BundleError(f"{where}: key postprocess.result: graph output(s) {dupes} named for two fields")
    for o in decl.options:
        if o.required and r.option(o.key) is None:
            raise BundleError(f"{where}: key postprocess.result.{o.key}: {o.required}")
    for key in r.options:
        if key not in decl.option_keys:
            raise BundleError(f"{where}: key postprocess.result.{key}: applies to "
                              f"{' and '.join(kinds.owners(key))}, not {r.kind}")
