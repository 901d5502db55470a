"""Decode only what the model needs: JPEG frames decoded at 1/2, 1/4 or 1/8 scale straight into the bundle's colours.

The scale comes from the frame size (read from the JPEG header) and the bundle's resize; a reduced frame
carries its scale so boxes map back to full-frame pixels, and `reduced_decode` reproduces the path for the self-test.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import cv2
import numpy as np

SCALES = (8, 4, 2, 1)

_REDUCED_BITS = {1: 0, 2: 16, 4: 32, 8: 64}  # the IMREAD_REDUCED_* bit of each scale, without the colour bits
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # markers with no length field

# FourCCs of Motion-JPEG video: their packets are JPEG pictures libjpeg can decode at reduced scale
MJPEG_FOURCCS = frozenset({"MJPG", "mjpg", "AVRn", "LJPG", "JPGL", "MJLS", "jpeg", "dmb1"})


def _as_array(data: Any) -> np.ndarray:
    """Encoded bytes (bytes, memoryview, or a uint8 array of any shape) as a flat uint8 array, without copying."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1)
    return np.frombuffer(data, np.uint8)


def is_jpeg(data: Any) -> bool:
    buf = _as_array(data)
    return buf.size > 3 and buf[0] == 0xFF and buf[1] == 0xD8


def jpeg_size(data: Any) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header, without decoding; None when it is not a JPEG we can read."""
    buf = _as_array(data)
    n = buf.size
    if not is_jpeg(buf):
        return None
    i = 2
    while i + 3 < n:
        if buf[i] != 0xFF:
            return None
        marker = int(buf[i + 1])
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = (int(buf[i + 2]) << 8) | int(buf[i + 3])
        if marker in _SOF_MARKERS:
            if i + 8 >= n:
                return None
            h = (int(buf[i + 5]) << 8) | int(buf[i + 6])
            w = (int(buf[i + 7]) << 8) | int(buf[i + 8])
            return (h, w) if h and w else None
        if marker == 0xDA or length < 2:  # start of scan before any frame header: not a baseline/progressive JPEG
            return None
        i += 2 + length
    return None


def needed_size(resize: Any, height: int, width: int) -> tuple[float, float] | None:
    """The smallest (height, width) a frame of this size can be decoded at and still give the model
    input the same geometry; None when any reduction would change it (no resize, unknown mode)."""
    if resize is None:
        return None
    mode = getattr(resize, "mode", "stretch")
    if mode == "stretch":
        return float(resize.height), float(resize.width)
    if mode == "letterbox":  # the frame is fitted inside the canvas: only the fitted size matters
        r = min(resize.width / width, resize.height / height)
        return height * r, width * r
    if mode == "short_side_crop":
        r = getattr(resize, "short_side", 0) / min(height, width)
        return (height * r, width * r) if r > 0 else None
    if mode == "fit_multiple" and getattr(resize, "limit_type", "max") == "max":
        limit = getattr(resize, "limit_side", 0)
        if limit <= 0 or max(height, width) <= limit:
            return None  # no downscale in the model's own resize: a reduced frame would change the tensor size
        r = limit / max(height, width)
        return height * r, width * r
    return None


def max_decode_scale(resize: Any, height: int, width: int) -> int:
    """The largest of 8, 4, 2, 1 at which the reduced frame is still at least what the model's resize needs."""
    need = needed_size(resize, height, width)
    if need is None:
        return 1
    for s in SCALES:
        if math.ceil(height / s) >= need[0] and math.ceil(width / s) >= need[1]:
            return s
    return 1


def decode_scale(setting: str | int, resize: Any, height: int, width: int, limit: int = 8) -> int:
    """The scale to decode a frame of this size at: `auto` picks the largest the resize allows, at most `limit`
    (the largest scale the self-test proved); a number is the user's choice, also capped at `limit`."""
    proven = max(s for s in SCALES if s <= max(limit, 1))
    if setting == "auto":
        return min(max_decode_scale(resize, height, width), proven)
    return min(int(setting), proven)  # a forced scale, but never above the proven one


def imread_flags(color: str, scale: int) -> int:
    """imdecode flags that decode at 1/scale straight into `color` (rgb, bgr or gray): no conversion afterwards."""
    if scale not in _REDUCED_BITS:
        raise ValueError(f"decode scale {scale} is not one of {sorted(_REDUCED_BITS)}")
    bits = _REDUCED_BITS[scale]
    if color == "gray":
        return cv2.IMREAD_GRAYSCALE | bits
    return (cv2.IMREAD_COLOR_RGB if color == "rgb" else cv2.IMREAD_COLOR_BGR) | bits


def decode_jpeg(data: Any, color: str, scale: int) -> np.ndarray | None:
    """Encoded bytes -> the frame at 1/scale in `color`; None when they do not decode."""
    buf = _as_array(data)
    if buf.size == 0:
        return None
    return cv2.imdecode(buf, imread_flags(color, scale))


def reduced_decode(raw: np.ndarray, scale: int, color: str = "rgb", quality: int = 95) -> np.ndarray:
    """What a source delivers for this raw frame when the camera sends it as JPEG and the agent decodes it
    at 1/scale: the self-test runs the bundle's preprocessing on this to prove the reduced path.

    `raw` is in the bundle's frame colour (`color`); the JPEG is encoded at `quality` (cameras: 75-95).
    """
    if raw.ndim == 3 and color == "rgb":
        bgr = cv2.cvtColor(raw, cv2.COLOR_RGB2BGR)
    else:
        bgr = raw
    ok, enc = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError(f"cannot encode a frame of shape {raw.shape} as JPEG")
    out = decode_jpeg(enc, color, scale)
    assert out is not None
    return out


def scaled_geometry(geometry: Any, scale: int, full: tuple[int, int] | None = None) -> Any:
    """The geometry of a frame decoded at 1/scale, re-expressed in full-frame pixels (boxes map to the camera's frame).
    `full`: the camera frame's (height, width) where known; else the reduced size times the scale, which is up to
    scale - 1 pixels more where the scale does not divide the size."""
    if scale == 1:
        return geometry
    # The frame size too: boxes are clipped to the frame, and the frame is the camera's, not the reduced one.
    frame_h, frame_w = full if full is not None else (geometry.frame_h * scale, geometry.frame_w * scale)
    return dataclasses.replace(geometry, scale_x=geometry.scale_x / scale, scale_y=geometry.scale_y / scale,
                               frame_w=frame_w, frame_h=frame_h)


def camera_sized_reduced(raw: np.ndarray, scale: int, color: str = "rgb", quality: int = 95) -> np.ndarray:
    """A golden frame as a camera `scale` times its size would deliver it through the reduced path: the frame
    scaled up (cubic), JPEG-encoded, decoded at 1/scale. For golden frames already at the model's size, where
    `reduced_decode` alone would never reduce: the self-test runs the model on this to prove scale `scale`."""
    h, w = raw.shape[:2]
    big = cv2.resize(raw, (w * scale, h * scale), interpolation=cv2.INTER_CUBIC)
    return reduced_decode(big, scale, color, quality)
