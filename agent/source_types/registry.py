"""The registry of source types: `type` name -> its config class, in registration order.

The config's schema, its parser, `config check` and the reference docs read it; the pipeline's openers are
registered beside it (`agent.serving.sources.register_source`). Built-in types register on import of
`agent.source_types`; a new type registers from its own module.
"""

from __future__ import annotations

import dataclasses
import typing

from agent.errors import ConfigError
from agent.source_types.keys import SourceConfig

_TYPES: dict[str, type[SourceConfig]] = {}
_GENERATION = [0]  # bumped by each change: what is made from the registry (the schema) is made again


def register(cls: type[SourceConfig]) -> type[SourceConfig]:
    """Add a source type: a frozen dataclass subclassing SourceConfig whose `type` field is a one-value Literal
    naming it (usable as a class decorator). Registering the same name again replaces it (a test's type)."""
    if not (isinstance(cls, type) and issubclass(cls, SourceConfig) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r}: a source type is a dataclass subclassing SourceConfig")
    hint = typing.get_type_hints(cls)["type"]
    names = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    if len(names) != 1 or not isinstance(names[0], str):
        raise TypeError(f"{cls.__name__}.type must be Literal['<name>'] (found {hint!r})")
    default = next(f.default for f in dataclasses.fields(cls) if f.name == "type")
    if default != names[0]:
        raise TypeError(f"{cls.__name__}.type must default to {names[0]!r} (found {default!r})")
    _TYPES[names[0]] = cls
    cls.TYPE = names[0]
    _GENERATION[0] += 1
    return cls


def unregister(name: str) -> None:
    """Remove a type (a test's throwaway type, after the test)."""
    if _TYPES.pop(name, None) is not None:
        _GENERATION[0] += 1


def generation() -> int:
    """Changes with each registration: a key for caches of what is made from the registry."""
    return _GENERATION[0]


def registered() -> dict[str, type[SourceConfig]]:
    """Every source type, name -> class, in registration order."""
    import agent.source_types  # noqa: F401  (the built-in types register on import)

    return dict(_TYPES)


def source_class(name: str) -> type[SourceConfig]:
    types = registered()
    try:
        return types[name]
    except KeyError:
        raise ConfigError(f"source.type: unknown source {name!r} (known: {sorted(types)})") from None


def types_reading(key: str) -> tuple[str, ...]:
    """The registered types whose class has `key` (the docs' "source types:" and the refusal's "read by:")."""
    return tuple(name for name, cls in registered().items() if key in {f.name for f in dataclasses.fields(cls)})


def common_keys() -> frozenset[str]:
    """The keys of SourceConfig itself: every type takes them."""
    return frozenset(f.name for f in dataclasses.fields(SourceConfig))
