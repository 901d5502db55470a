"""The source types: one config class per `source.type`, each in its own module, and the registry that maps
a type name to its class (the discriminated union the config is parsed into).

`keys` declares the keys every source takes and the key groups several types share (the groups are the
type families: pictures decoded by FFmpeg, sensor samples, network receivers); each built-in type composes
the groups it reads. A new type is one module declaring its class plus `register(...)`: the config's
schema, `config check`, the reference docs and the pipeline's opener table all read the registry.
"""

from __future__ import annotations

from agent.source_types.keys import (DEFAULT_TYPE, FfmpegKeys, NetworkKeys, PathKey, PictureKeys, PlaybackKeys,
                                     SampleKeys, SourceConfig)
from agent.source_types.registry import register, registered, source_class
from agent.source_types import folder, video, camera, stream, udp, file, stdin, mqtt  # noqa: F401  (registers)
from agent.source_types.folder import FolderSourceConfig
from agent.source_types.video import VideoSourceConfig
from agent.source_types.camera import CameraSourceConfig
from agent.source_types.stream import StreamSourceConfig
from agent.source_types.udp import UdpSourceConfig
from agent.source_types.file import FileSourceConfig
from agent.source_types.stdin import StdinSourceConfig
from agent.source_types.mqtt import MqttSourceConfig

__all__ = ["DEFAULT_TYPE", "SourceConfig", "PathKey", "PlaybackKeys", "FfmpegKeys", "PictureKeys", "SampleKeys",
           "NetworkKeys", "register", "registered", "source_class", "FolderSourceConfig", "VideoSourceConfig", "CameraSourceConfig",
           "StreamSourceConfig", "UdpSourceConfig", "FileSourceConfig", "StdinSourceConfig", "MqttSourceConfig"]
