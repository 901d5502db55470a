"""A throwaway source type, the whole of it in this one module: its config class and its opener.

tests/source_types/test_source_types.py registers it (`register_source`) and nothing else in the tree names it: config
parsing, `config check`, the generated schema and docs, and the pipeline must take it from the registry.
It plays a folder's PNGs `frames` times round, as a camera would hand them over (never from the network).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from agent.errors import ConfigError
from agent.keydoc import Key
from agent.serving.sources import Frame, SourceStats
from agent.source_types import SourceConfig
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.vocabulary.preprocess import read_image_file


@dataclass(frozen=True)
class TickSourceConfig(SourceConfig):
    TITLE = "tick (a test's frames)"

    type: Literal["tick"] = "tick"
    pictures: Annotated[Path | None, Key("tick: a folder of PNGs, played in name order")] = None
    frames: Annotated[int, Key("tick: how many frames before the source ends", ge=1)] = 3


class TickSource:
    live = False

    def __init__(self, cfg: TickSourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None,
                 max_scale: int = 8):
        if cfg.pictures is None:
            raise ConfigError("source.pictures: a tick source needs a folder of PNGs")
        self.files = sorted(Path(cfg.pictures).glob("*.png"))
        self.cfg, self.frame = cfg, frame
        self.name = cfg.name or f"tick:{cfg.pictures}"
        self.stats = SourceStats(state="open")

    def read(self, stop: threading.Event) -> Frame | None:
        self.stats.beat()
        if stop.is_set() or self.stats.frames >= self.cfg.frames:
            self.stats.state = "ended"
            return None
        path = self.files[self.stats.frames % len(self.files)]
        data = read_image_file(str(path), self.frame)
        self.stats.frames += 1
        self.stats.last_frame_ns = time.perf_counter_ns()
        return Frame(self.stats.frames, data, time.time(), self.stats.last_frame_ns, path.name)

    def close(self) -> None:
        pass
