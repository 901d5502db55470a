"""The `udp` source type: sensor samples in datagrams, one stream per sender."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from agent.keydoc import Key
from agent.source_types.keys import NetworkKeys, SampleKeys, SourceConfig
from agent.source_types.registry import register


@register
@dataclass(frozen=True)
class UdpSourceConfig(NetworkKeys, SampleKeys, SourceConfig):
    TITLE = "udp"

    type: Literal["udp"] = "udp"
    max_streams: Annotated[int, Key("udp: senders served at once, each its own stream; more are refused and "
                                    "counted", ge=1)] = 16
    stream_timeout_s: Annotated[float, Key("udp: a sender quiet this long ends its stream and frees its place",
                                           ge=0.1)] = 30.0
    framing: Annotated[Literal["none", "seq32"], Key(
        "udp: none: a datagram is samples; seq32: each starts with its sender's sequence number (uint32, "
        "little-endian, +1 per datagram): a jump is counted as lost samples and resets the stream, a number "
        "already passed is counted late and dropped")] = "none"
    receive_buffer_bytes: Annotated[int, Key("udp: the socket's receive buffer (SO_RCVBUF; 0: the system's "
                                             "default); datagrams it had no room for are counted as lost", ge=0)] = 0
