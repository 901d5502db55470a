"""JPEG frames at the smallest scale the bundle's resize allows (libjpeg decodes at 1/2, 1/4, 1/8), shared by the
folder, OpenCV and MQTT picture sources: the scale chosen, said when it changes, and the camera size behind it."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.source_types import (PictureKeys)
from agent.logsetup import get_logger
from agent.serving.decoding import decode_jpeg, decode_scale, jpeg_size
from agent.vocabulary.yuv import reduced_size
from agent.vocabulary.manifest import FrameSpec, ResizeSpec

from agent.serving.frames import SourceStats

log = get_logger("source")


EXIF_TURNS = -1  # a still JPEG: libjpeg turns it by its EXIF orientation, which we do not read before decoding


def scale_for(cfg: PictureKeys, resize: ResizeSpec | None, height: int, width: int, max_scale: int,
               turns: int) -> tuple[int, int | None]:
    """(The scale to reduce a picture of this size to, the scale it was lowered from or None.) A turned picture
    keeps each reduced pixel on its block only where the scale divides its size: the rounded-up edge (libjpeg's
    partial block, our padding) is at the right and bottom before the turn, elsewhere after it (a review: boxes
    2 pixels off at 1/4). Halved until it divides (phones' 1920 x 1080 and 4K keep 1/8); a forced scale too."""
    wanted = scale = decode_scale(cfg.decode_scale, resize, height, width, limit=max_scale)
    while turns and scale > 1 and (height % scale or width % scale):
        scale //= 2
    return scale, (wanted if scale != wanted else None)


def log_scale(name: str, scale: int, size: tuple[int, int] | None, lowered: int | None, cfg: PictureKeys,
               **extra: Any) -> None:
    h, w = size if size is not None else (0, 0)
    why = None if lowered is None else (f"a turned picture is reduced only at a scale that divides its size "
                                        f"({w}x{h}: not 1/{lowered})")
    # a scale the config forced and the agent lowered is said as a warning: the user asked for it
    (log.warning if lowered is not None and cfg.decode_scale != "auto" else log.info)(
        "source.decode_scale", source=name, scale=scale, frame=None if size is None else f"{w}x{h}",
        decoded=None if size is None else f"{-(-w // scale)}x{-(-h // scale)}", lowered_from=lowered,
        reason=why, **extra)


def jpeg_scale(data: np.ndarray, cfg: PictureKeys, resize: ResizeSpec | None, max_scale: int, stats: SourceStats,
                name: str, size: tuple[int, int] | None, turns: int = 0) -> int:
    """The scale to decode this JPEG of `size` (its header's, as displayed; None: unknown) at, recorded in the
    source's stats when it changes. `turns` EXIF_TURNS: it may be turned, the scale must divide its size."""
    scale, lowered = (1, None) if size is None else scale_for(cfg, resize, *size, max_scale, turns)
    if stats.decoder.get("scale") != scale or stats.decoder.get("path") != "jpeg":
        log_scale(name, scale, size, lowered, cfg)
        stats.decoder = {**stats.decoder, "path": "jpeg", "scale": scale, "lowered_from": lowered}
    return scale


def camera_size(size: tuple[int, int] | None, img: np.ndarray, scale: int) -> tuple[int, int] | None:
    """The (height, width) of the picture of header size `size` that a JPEG decoded at 1/scale into `img` (turned
    as its EXIF orientation turned it), for boxes to clip to; None at full scale or where the header does not
    say. The scale divides a still JPEG's size (EXIF_TURNS), so the reduced shape names the turn, but a square's."""
    if size is None or scale == 1:
        return None
    for hw in (size, (size[1], size[0])):
        if reduced_size(*hw, scale) == img.shape[:2]:
            return hw
    return None


def decode_jpeg_frame(data: np.ndarray, cfg: PictureKeys, frame: FrameSpec, resize: ResizeSpec | None,
                       max_scale: int, stats: SourceStats,
                       name: str) -> tuple[np.ndarray | None, int, tuple[int, int] | None]:
    """One JPEG -> (the frame at the scale the model allows, in the bundle's colours, scale, the picture's
    (height, width) where reduced); (None, 1, None) when it does not decode."""
    size = jpeg_size(data)
    scale = jpeg_scale(data, cfg, resize, max_scale, stats, name, size, EXIF_TURNS)
    img = decode_jpeg(data, frame.color, scale)
    return (None, 1, None) if img is None else (img, scale, camera_size(size, img, scale))
