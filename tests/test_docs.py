"""One place for each fact: README's tables are checked against the code that defines the facts."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from agent.config import Config
from agent.link.topics import Topics

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "source_file":
            continue
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        target = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        if target is not None:
            out += _keys(target, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_config_key_is_documented_in_the_readme() -> None:
    missing = [k for k in _keys(Config) if f"`{k}`" not in README]
    assert not missing, f"README's config table lacks {missing}"


def test_every_topic_is_documented_in_the_readme() -> None:
    missing = [t for t in Topics.documented() if f"`{t}`" not in README]
    assert not missing, f"README's topic table lacks {missing}"
