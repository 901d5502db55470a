"""The `video` source type: a video file, decoded by FFmpeg (PyAV) or OpenCV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.source_types.keys import PathKey, PlaybackKeys, FfmpegKeys, PictureKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class VideoSourceConfig(PathKey, PlaybackKeys, FfmpegKeys, PictureKeys, SourceConfig):
    TITLE = "video"

    type: Literal["video"] = "video"
