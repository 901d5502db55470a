"""The `stream` source type: a network stream (http(s) MJPEG, rtsp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from agent.keydoc import Key
from agent.source_types.keys import FfmpegKeys, PictureKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class StreamSourceConfig(FfmpegKeys, PictureKeys, SourceConfig):
    TITLE = "stream (http MJPEG, rtsp)"

    type: Literal["stream"] = "stream"
    url: Annotated[str | None, Key("http(s) MJPEG or rtsp:// stream")] = None
