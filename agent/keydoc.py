"""What a config key means and allows: one definition that the schema, the checks and the docs read.

A settings dataclass annotates each field as `Annotated[type, Key("what it does", ge=..., le=...)]`;
`agent.config_schema` turns the annotations into the JSON Schema the config is validated with, and
`scripts/gen_docs.py` into the reference table in docs/reference/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """A config key's documentation and range. `default_doc`: how the docs state a default computed at run
    time. (Which source types read a source key is not said here: it is the key's place in a type's class,
    agent/source_types.)"""

    doc: str = ""
    ge: float | None = None
    le: float | None = None
    default_doc: str | None = None
    secret: bool = False
    pattern: str | None = None  # a regular expression the whole value must match
