"""The config's JSON Schema, made from the settings dataclasses, and the checks that use it.

One validation mechanism for config and manifest: both are checked by a JSON Schema with
`jsonschema` (the manifest's is a file, `agent/schema/bundle.schema.json`; the config's is made
here from the dataclasses' type hints and their `Key` annotations, so each default and range is
defined once, on its field). JSON Schema rather than pydantic or msgspec: the manifest already uses
it, it adds no dependency with a compiled core to a device daemon, and the same schema documents
the keys (docs/reference/config.md is generated from it). Errors name the file and the key path.
`source:` is the discriminated union of the registered source types (agent.source_types): the same
mechanism states it in one rule per type, so no second validator (pydantic, msgspec) is needed for it.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import jsonschema

from agent.errors import ConfigError
from agent.keydoc import Key
from agent.source_types import DEFAULT_TYPE, SourceConfig, registered, source_class
from agent.source_types.registry import generation, types_reading

JSON_TYPE_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
                   "array": "a list", "object": "a mapping", "null": "nothing"}


def key_of(hint: Any) -> Key:
    """The `Key` annotation of a field's type hint (an empty one when it has none)."""
    if typing.get_origin(hint) is typing.Annotated:
        for extra in hint.__metadata__:
            if isinstance(extra, Key):
                return extra
    return Key()


def bare(hint: Any) -> Any:
    """The type inside `Annotated[...]`."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint


def field_hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _type_schema(tp: Any) -> dict[str, Any]:
    tp = bare(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            return {"anyOf": [_type_schema(a) for a in args]}
        sub = _type_schema(inner[0])
        if type(None) in args:
            if "type" in sub:
                kinds = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
                sub = {**sub, "type": kinds + ["null"]}
            elif "enum" in sub:
                sub = {**sub, "enum": [*sub["enum"], None]}
            else:
                sub = {"anyOf": [sub, {"type": "null"}]}
        return sub
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (tuple, list):
        return {"type": "array", "items": _type_schema(args[0])}
    if origin in (collections.abc.Mapping, dict) or tp is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1]) if args else {}}
    if dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": ["string", "number"]}  # `device: 0`, `device_id: 7`: read as text
    if tp is Path:
        return {"type": "string", "minLength": 1}
    if tp is Any:
        return {}
    raise TypeError(f"no JSON Schema for setting type {tp!r}")


def _properties(cls: Any) -> dict[str, Any]:
    hints = field_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "source_file":
            continue
        key = key_of(hints[f.name])
        sub = _type_schema(hints[f.name])
        if key.ge is not None:
            sub["minimum"] = key.ge
        if key.le is not None:
            sub["maximum"] = key.le
        if key.pattern is not None:
            sub["pattern"] = f"^(?:{key.pattern})$"
        if key.doc:
            sub["description"] = key.doc
        props[f.name] = sub
    return props


def dataclass_schema(cls: Any) -> dict[str, Any]:
    if cls is SourceConfig:
        return source_schema()
    return {"type": "object", "properties": _properties(cls), "additionalProperties": False}


def source_schema() -> dict[str, Any]:
    """`source:` as the discriminated union of the registered types: every type's keys are known keys, and for
    each `type` (no `type` is the default one) a rule refuses the keys its class does not have (`false`)."""
    types_ = registered()
    own = {name: _properties(cls) for name, cls in types_.items()}
    props: dict[str, Any] = {}
    for schemas in own.values():
        for key, sub in schemas.items():
            if key not in props:
                props[key] = sub
            elif props[key] != sub:  # two types declare the key differently: each type's rule checks its own
                props[key] = {k: v for k, v in props[key].items() if k == "description"}
    props["type"] = {"enum": list(types_), "description": ", ".join(c.TITLE or n for n, c in types_.items())}
    rules = []
    for name, schemas in own.items():
        then = {key: False for key in props if key not in schemas}
        then.update({key: sub for key, sub in schemas.items() if key != "type" and props[key] != sub})
        if not then:
            continue
        cond: dict[str, Any] = {"properties": {"type": {"const": name}}, "required": ["type"]}
        if name == DEFAULT_TYPE:  # no `type` key means the default type
            cond = {"anyOf": [cond, {"not": {"required": ["type"]}}]}
        rules.append({"if": cond, "then": {"properties": then}})
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if rules:
        schema["allOf"] = rules
    return schema


def config_schema() -> dict[str, Any]:
    return _config_schema(generation())  # made again once a source type is registered


@functools.cache
def _config_schema(_generation: int) -> dict[str, Any]:
    from agent.config import Config

    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "edge-agent config",
            **dataclass_schema(Config)}


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _words(kinds: Any) -> str:
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds and "number" in kinds:
        kinds = [k for k in kinds if k != "number"]
    words = [JSON_TYPE_WORDS.get(k, k) for k in kinds if k != "null"]
    if "minLength" in kinds:
        words = ["a path"]
    return " or ".join(words) + (" (or nothing)" if "null" in kinds else "")


def _unused_source_key(data: Any, path: list[Any]) -> str | None:
    """A false schema's error (a key the source's type does not read) points at the source mapping:
    name the key itself, and the types that do read it."""
    node = data
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return None
    if not isinstance(node, dict):
        return None
    kind = node.get("type", DEFAULT_TYPE)
    cls = registered().get(kind)
    if cls is None:
        return None
    has = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(node):
        used = types_reading(name) if name not in has else ()
        if used:
            return (f"key {_path([*path, name])}: not used by a {kind!r} source (read by: {', '.join(used)}); "
                    f"remove it or change the type")
    return None


# Keys that existed once and do nothing now: a config that still sets one is told what replaced it.
RETIRED = {
    "mqtt.max_running_commands": "removed: commands wait in the controller's one bounded queue (a full one is "
                                 "answered busy) and slow ones run as operations, one at a time",
}


def describe(error: jsonschema.ValidationError, data: Any = None) -> str:
    """One schema error in the agent's words: the key path, what was expected, what was found."""
    where = _path(error.absolute_path)
    v, found = error.validator, error.instance
    if v is None:  # a `false` schema: a source key its type does not read
        return _unused_source_key(data, list(error.absolute_path)) or f"key {where}: {error.message}"
    if v == "additionalProperties" and isinstance(found, dict):
        known = sorted((error.schema.get("properties") or {}))
        extra = sorted(k for k in found if k not in known)
        name = extra[0] if extra else "?"
        path = _path([*error.absolute_path, name])
        if path in RETIRED:
            return f"key {path}: {RETIRED[path]}; delete the line"
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        hint = f"; did you mean {_path([*error.absolute_path, close[0]])!r}?" if close else ""
        return f"key {path}: unknown key{hint} (known here: {known})"
    if v == "type":
        if error.validator_value == "string" and error.schema.get("minLength"):
            return f"key {where}: expected a path, found {found!r}"
        return f"key {where}: expected {_words(error.validator_value)}, found {found!r}"
    if v == "minimum":
        return f"key {where}: expected >= {error.validator_value:g}, found {found!r}"
    if v == "maximum":
        return f"key {where}: expected <= {error.validator_value:g}, found {found!r}"
    if v == "enum":
        return f"key {where}: expected one of {list(error.validator_value)}, found {found!r}"
    if v == "pattern":
        return f"key {where}: {found!r} is not allowed here ({error.schema.get('description', error.message)})"
    if v == "minLength":
        return f"key {where}: expected a path, found {found!r}"
    return f"key {where}: {error.message}"


def _validator() -> jsonschema.Draft202012Validator:
    return _validator_of(generation())


@functools.cache
def _validator_of(_generation: int) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(config_schema())


def _false_schema_errors(errors: list[jsonschema.ValidationError]) -> list[jsonschema.ValidationError]:
    """if/then failures point at the `then`; the useful error is the key whose schema is `false`."""
    out = []
    for e in errors:
        if e.validator == "if" or e.validator == "allOf":
            out += _false_schema_errors(list(e.context or [])) or [e]
        else:
            out.append(e)
    return out


def validate(data: Mapping[str, Any], where: str) -> None:
    """Raise ConfigError naming `where` and the first bad key (sorted by key path: stable across runs)."""
    errors = _false_schema_errors(list(_validator().iter_errors(data)))
    if not errors:
        return
    errors.sort(key=lambda e: [str(p) for p in e.absolute_path])
    raise ConfigError(f"{where}: {describe(errors[0], data)}")


def build(cls: Any, data: Mapping[str, Any]) -> Any:
    """Typed settings from data the schema accepted (lists become tuples, strings paths)."""
    hints = field_hints(cls)
    return cls(**{name: _value(hints[name], value) for name, value in data.items()})


def _value(tp: Any, value: Any) -> Any:
    tp = bare(tp)
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value) if len(inner) == 1 else value
    if origin in (tuple, list):
        return tuple(_value(args[0], v) for v in value)
    if origin in (collections.abc.Mapping, dict):
        return {str(k): _value(args[1], v) if args else v for k, v in value.items()}
    if tp is SourceConfig:  # the union: the class `type` names
        return build(source_class(str(value.get("type", DEFAULT_TYPE))), value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value)
    if tp is float:
        return float(value)
    if tp is str:
        return str(value)
    if tp is Path:
        return Path(value)
    return value
