"""The keys every source takes, and the key groups that source types share: each group is declared once here.

A type's class composes the groups it reads (`class VideoSourceConfig(PathKey, PlaybackKeys, FfmpegKeys, PictureKeys,
SourceConfig)`), so a group is both its keys and the family: `isinstance(cfg, FfmpegKeys)` is "decoded by
FFmpeg/OpenCV", `isinstance(cfg, SampleKeys)` "delivers sensor samples". A key a type's class lacks is
refused by the schema, naming the types that read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

from agent.keydoc import Key

DEFAULT_TYPE = "folder"  # a source mapping without `type:`
FrameKind = Literal["image", "sensor"]
PictureScale = Literal["auto", 1, 2, 4, 8]


@dataclass(frozen=True)
class SourceConfig:
    """Where frames come from: the keys every type takes. `SourceConfig(type="video", path=...)` makes the
    registered class of that type (`VideoSourceConfig`); each type's class adds the keys it reads."""

    TYPE: ClassVar[str] = ""  # the type's name, set when it is registered
    TITLE: ClassVar[str] = ""  # how the type is listed in `source.type`'s documentation, e.g. "stream (rtsp)"

    type: Annotated[str, Key("the source's type; each type's keys are listed with it")] = DEFAULT_TYPE
    name: Annotated[str | None, Key("how results, topics and health name this source (required in sources:)",
                                    default_doc="type:target")] = None
    lossless: Annotated[bool | None, Key("false: latest-frame-wins; default: lossless for folder/video/file, "
                                         "latest-frame-wins for live sources", default_doc="by type")] = None
    stall_timeout_s: Annotated[float, Key("no new frame for this long: the stream is lost, reopen", ge=0.1)] = 5.0
    frozen_after: Annotated[int, Key("this many identical consecutive frames: report a frozen picture", ge=1)] = 30
    reconnect_initial_s: Annotated[float, Key("first reconnect wait (doubles, with jitter)", ge=0)] = 0.5
    reconnect_max_s: Annotated[float, Key("longest reconnect wait", ge=0)] = 30.0

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # `SourceConfig(type=...)` is the union's constructor: it makes the registered class of that type
        if cls is SourceConfig:
            from agent.source_types.registry import source_class

            cls = source_class(str(kwargs.get("type", DEFAULT_TYPE)))
        return object.__new__(cls)

    def delivers(self) -> FrameKind:
        """What the source's frames are: pictures for an image bundle, or sensor samples cut into windows."""
        return "sensor" if isinstance(self, SampleKeys) and not isinstance(self, PictureKeys) else "image"

    def picture_scale(self) -> PictureScale | None:
        """`decode_scale` where the type decodes pictures; None where it never does (sensor samples)."""
        return None

    def io_timeouts_ms(self) -> tuple[int, int]:
        """(open, read) time-outs of the source's reads: the FFmpeg keys where the type has them, else their
        defaults (the multiplexer's bound on a read that does not return)."""
        return FfmpegKeys.open_timeout_ms, FfmpegKeys.read_timeout_ms


# -- the groups ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PathKey:
    path: Annotated[Path | None, Key("folder: images; video: a file; file: a FIFO or character device")] = None

    def under(self, base: Path) -> Self:
        """The same source with a relative path taken as relative to `base` (its config file's folder)."""
        if self.path is None or self.path.is_absolute():
            return self
        return dataclasses.replace(self, path=base / self.path)


@dataclass(frozen=True)
class PlaybackKeys:
    """Recorded frames (a folder, a video file): read at a pace, again at the end."""

    loop: Annotated[bool, Key("start again at the end")] = False
    max_fps: Annotated[float, Key("pace reading (0: as fast as the pipeline takes frames)", ge=0)] = 0.0


@dataclass(frozen=True)
class FfmpegKeys:
    """Camera-like sources: decoded by FFmpeg (PyAV) or OpenCV, with time-outs and reconnects."""

    open_timeout_ms: Annotated[int, Key("OpenCV open time-out", ge=1)] = 5000
    read_timeout_ms: Annotated[int, Key("OpenCV read time-out", ge=1)] = 3000
    decoder_threads: Annotated[int, Key("FFmpeg decoder threads (0: 2 at open, or the cores shared among the "
                                        "sources, then sized by the stage planner)", ge=0)] = 0
    hw_decode: Annotated[Literal["none", "any", "vaapi", "cuda", "d3d11", "mfx", "drm", "v4l2m2m"], Key(
        "FFmpeg hardware decoding (PyAV's hwaccel; v4l2m2m: FFmpeg's V4L2 decoders); falls back to software, "
        "the reason in health")] = "none"

    def io_timeouts_ms(self) -> tuple[int, int]:
        return self.open_timeout_ms, self.read_timeout_ms


@dataclass(frozen=True)
class PictureKeys:
    """Sources of pictures: JPEGs among them decode at a reduced scale."""

    decode_scale: Annotated[PictureScale, Key(
        "JPEG frames: decode at 1/2, 1/4 or 1/8; auto: the smallest the bundle's resize allows and the self-test "
        "proved; 1: full size")] = "auto"

    def picture_scale(self) -> PictureScale | None:
        return self.decode_scale


@dataclass(frozen=True)
class SampleKeys:
    """Sensor streams: samples cut into the bundle's windows."""

    sample_dtype: Annotated[Literal["float32", "int16", "uint8"] | None,
                            Key("sensor samples, little-endian; cast to the bundle's frame.dtype, never "
                                "rescaled: integer samples into a float frame (or floats into an integer one) "
                                "are refused", default_doc="the bundle's frame.dtype")] = None
    hop: Annotated[int, Key("sensor: samples between windows (0: the bundle's frame.hop, else the window)", ge=0)] = 0
    sample_rate: Annotated[float, Key("sensor: samples per second the senders send (0: not declared); refused unless "
                                      "it is the bundle's frame.sample_rate, and a sender measured off it by more "
                                      "than 10% is reported", ge=0)] = 0.0
    channels: Annotated[int, Key("sensor: interleaved channels the senders send (0: not declared); refused unless "
                                 "it is the bundle's frame.channels", ge=0)] = 0


@dataclass(frozen=True)
class NetworkKeys:
    """Network receivers: samples or frames pushed to the agent, buffered while it is behind."""

    host: Annotated[str, Key("udp: bind address; mqtt: the frames' broker")] = "127.0.0.1"
    port: Annotated[int, Key("udp: bind port; mqtt: the broker's port (0: 1883)", ge=0, le=65535)] = 0
    max_backlog_s: Annotated[float, Key("udp, mqtt samples: seconds of a stream's samples kept while the agent is "
                                        "behind; beyond that they are shed, counted as lost and the stream (and its "
                                        "state) starts again", ge=0.1)] = 60.0
