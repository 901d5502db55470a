"""The `stdin` source type: sensor samples on the agent's standard input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.source_types.keys import SampleKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class StdinSourceConfig(SampleKeys, SourceConfig):
    TITLE = "stdin"

    type: Literal["stdin"] = "stdin"
