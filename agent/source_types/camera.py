"""The `camera` source type: a local camera (an index or /dev/videoN)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from agent.keydoc import Key
from agent.source_types.keys import FfmpegKeys, PictureKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class CameraSourceConfig(FfmpegKeys, PictureKeys, SourceConfig):
    TITLE = "camera"

    type: Literal["camera"] = "camera"
    device: Annotated[str | None, Key("camera index (\"0\") or /dev/videoN")] = None

    def is_v4l2_index(self) -> bool:
        """A camera index ("0") opens through OpenCV's V4L2 backend, never PyAV."""
        return (self.device or "0").isdigit()
