"""What the pipeline and health may read from a source beyond `FrameSource`: one small Protocol each.

A source has a capability by having its members; callers ask `isinstance(source, Multiplexed)` and get a
typed value, never `getattr(source, "name", None)` (tests/source_types/test_source_types.py greps for that). Each
Protocol names its implementers, so a new source type sees what it may offer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from agent.vocabulary.manifest import ResizeSpec

if TYPE_CHECKING:
    from agent.serving.multisource import Feed
    from agent.serving.sources import Frame, FrameSource


@runtime_checkable
class Retargetable(Protocol):
    """Decodes pictures at a scale: a new bundle's resize and proven scale apply from its next frame on
    (FolderSource, OpenCVSource, MqttFrameSource)."""

    resize: ResizeSpec | None
    max_scale: int


@runtime_checkable
class SkipsNonReference(Protocol):
    """A codec that can leave frames no other frame references undecoded while the last one still waits
    (OpenCVSource through PyAV): latest-frame-wins decodes less."""

    def skip_nonref(self, on: bool) -> None: ...


@runtime_checkable
class SharesDecoderThreads(Protocol):
    """Opens its decoder with `open_threads` threads (0: not set): the multiplexer shares the cores among its
    sources (OpenCVSource)."""

    open_threads: int


@runtime_checkable
class ReportsStreams(Protocol):
    """Carries several streams (sensor senders, a FIFO's writer sessions): their health by name (SensorSource)."""

    def streams_health(self) -> dict[str, Any]: ...


@runtime_checkable
class Multiplexed(Protocol):
    """Many sources behind one (MultiSource): each feed's own health, its stuck reads, its fresher frames."""

    on_drop: Callable[[str, int], None] | None

    @property
    def feeds(self) -> Sequence[Feed]: ...

    def freshest(self, frame: Frame) -> Frame | None: ...

    def stuck(self, horizon_s: float | None = None) -> dict[str, float]: ...

    def per_source(self) -> dict[str, dict[str, Any]]: ...

    def state_key(self) -> tuple[str, ...]: ...

    def capture_cpu_ms(self) -> float: ...


def inner_sources(source: FrameSource) -> list[FrameSource]:
    """The sources behind `source`: each feed's of a multiplexer, else itself."""
    return [f.source for f in source.feeds] if isinstance(source, Multiplexed) else [source]
