"""The `mqtt` source type: frames (images, .npy, raw) or sensor samples arriving on a broker's topic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from agent.keydoc import Key
from agent.source_types.keys import FrameKind, NetworkKeys, PictureKeys, SampleKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class MqttSourceConfig(NetworkKeys, SampleKeys, PictureKeys, SourceConfig):
    TITLE = "mqtt"

    type: Literal["mqtt"] = "mqtt"
    topic: Annotated[str | None, Key("mqtt: where frames arrive")] = None
    payload: Annotated[Literal["image", "npy", "raw", "samples"], Key(
        "mqtt: an encoded image, .npy bytes, raw frame bytes, or samples: chunks of one sensor stream's samples "
        "(any length; windows cut in stream time, as udp)")] = "image"
    framing: Annotated[Literal["none", "seq32"], Key(
        "mqtt, payload samples: none: a payload is samples; seq32: each starts with its publisher's sequence "
        "number (uint32, little-endian, +1 per payload): a jump (a payload the broker dropped) is counted as lost "
        "samples and resets the stream, a number already passed is counted late and dropped")] = "none"

    def delivers(self) -> FrameKind:
        return "sensor" if self.payload == "samples" else "image"
