"""The `file` source type: sensor samples from a FIFO, a character device or a file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.source_types.keys import PathKey, SampleKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class FileSourceConfig(PathKey, SampleKeys, SourceConfig):
    TITLE = "file (FIFO, device)"

    type: Literal["file"] = "file"
