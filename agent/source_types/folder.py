"""The `folder` source type: image files of a folder, in name order (the demo's default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.source_types.keys import PathKey, PlaybackKeys, PictureKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class FolderSourceConfig(PathKey, PlaybackKeys, PictureKeys, SourceConfig):
    TITLE = "folder"

    type: Literal["folder"] = "folder"
