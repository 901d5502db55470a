"""Decode only what the model needs, for video codecs (H.264/H.265...): the decoder's 4:2:0 planes are
averaged down to 1/scale first, and only the reduced picture is converted to the bundle's colours.

A JPEG can be decoded at reduced scale inside libjpeg; an H.264 frame cannot (its prediction needs every
pixel), so the saving is in what follows the decode: no full-size YUV->BGR conversion, no full-size
BGR->RGB, no full-size resize. Area averaging commutes with the (affine) colour conversion, so the reduced
frame is the full frame, converted then area-reduced, up to rounding. A reduced frame carries its scale
(boxes map back with jpeg.scaled_geometry); `camera_sized_reduced_yuv` reproduces the path for the self-test.

Pure numpy/OpenCV: the self-test one floor down can prove the very path the video sources take.
"""

from __future__ import annotations

import cv2
import numpy as np

# (Kr, Kb) of the colour matrices a camera tags its stream with; untagged streams are BT.601, as swscale assumes
_KR_KB = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}


def reduced_size(height: int, width: int, scale: int) -> tuple[int, int]:
    """The (height, width) of a frame decoded at 1/scale: rounded up, as libjpeg does for JPEG."""
    return -(-height // scale), -(-width // scale)


def yuv_to_rgb_matrix(matrix: str = "bt601", full_range: bool = False) -> np.ndarray:
    """The 3x4 affine map [Y, U, V, 1] -> [R, G, B] (uint8 codes) for cv2.transform."""
    kr, kb = _KR_KB[matrix]
    kg = 1.0 - kr - kb
    ys, cs, y0 = (1.0, 1.0, 0.0) if full_range else (255 / 219, 255 / 224, 16.0)
    rv = 2 * (1 - kr) * cs
    bu = 2 * (1 - kb) * cs
    gu, gv = -bu * kb / kg, -rv * kr / kg
    m = np.array([[ys, 0.0, rv], [ys, gu, gv], [ys, bu, 0.0]], np.float64)
    offset = -(m @ np.array([y0, 128.0, 128.0]))
    return np.hstack([m, offset[:, None]]).astype(np.float32)


def _gray_lut(full_range: bool) -> np.ndarray:
    if full_range:
        return np.arange(256, dtype=np.uint8)
    return np.clip(np.round((np.arange(256) - 16.0) * 255 / 219), 0, 255).astype(np.uint8)


_GRAY = {False: _gray_lut(False), True: _gray_lut(True)}
_MATRICES: dict[tuple[str, bool, str], np.ndarray] = {}


def _matrix(matrix: str, full_range: bool, color: str) -> np.ndarray:
    key = (matrix, full_range, color)
    m = _MATRICES.get(key)
    if m is None:
        m = yuv_to_rgb_matrix(matrix, full_range)
        if color == "bgr":
            m = m[::-1].copy()
        _MATRICES[key] = m
    return m


def area_reduce(plane: np.ndarray, height: int, width: int) -> np.ndarray:
    """A plane averaged down to height x width. Halving is OpenCV's fast path (0.12 ms for a 1080p luma plane,
    against 1.25 ms for one INTER_AREA step of 1/8 on this machine), and the mean of 2x2 means is the mean of
    the 4x4 block (up to a rounding per step): halve while the sizes allow, then one area step for the rest."""
    while plane.shape[0] >= 2 * height and plane.shape[1] >= 2 * width and not plane.shape[0] % 2 \
            and not plane.shape[1] % 2:
        plane = cv2.resize(plane, (plane.shape[1] // 2, plane.shape[0] // 2), interpolation=cv2.INTER_AREA)
    if plane.shape[:2] != (height, width):
        plane = cv2.resize(plane, (width, height), interpolation=cv2.INTER_AREA)
    return plane


def pad_to(plane: np.ndarray, height: int, width: int) -> np.ndarray:
    """The plane with its last row and column repeated out to height x width (a copy; the plane when it fits)."""
    if plane.shape[:2] == (height, width):
        return plane
    return cv2.copyMakeBorder(plane, 0, height - plane.shape[0], 0, width - plane.shape[1], cv2.BORDER_REPLICATE)


def reduce_exact(img: np.ndarray, scale: int) -> np.ndarray:
    """A picture at 1/scale where each output pixel is the mean of the scale x scale block at scale times its
    position, as libjpeg's reduced decode: boxes map back by the scale alone. A size the scale does not divide is
    padded out by its edge first (an area resize straight to the rounded-up size would stretch the picture by
    up to scale - 1 pixels: 1366 wide at 1/4 mapped back to 1368)."""
    if scale == 1:
        return img
    rh, rw = reduced_size(img.shape[0], img.shape[1], scale)
    return area_reduce(pad_to(img, rh * scale, rw * scale), rh, rw)


def yuv420_to_frame(y: np.ndarray, u: np.ndarray, v: np.ndarray, scale: int, color: str = "rgb",
                    matrix: str = "bt601", full_range: bool = False, bits: int = 8) -> np.ndarray:
    """4:2:0 planes (luma h x w, chroma (h+1)//2 x (w+1)//2; strided views are fine, nothing is copied
    at full size unless the scale does not divide the size) -> the frame at 1/scale in `color` (rgb, bgr or
    gray), each pixel the mean of its scale x scale block (`reduce_exact`). `bits` > 8: uint16 planes (10-bit video),
    reduced at their depth, then brought to 8 bits."""
    ys = to_8bit(reduce_exact(y, scale), bits)
    if color == "gray":
        return cv2.LUT(ys, _GRAY[full_range])
    if scale == 1:  # full size: chroma interpolated up
        rh, rw = ys.shape[:2]
        us = cv2.resize(u, (rw, rh), interpolation=cv2.INTER_LINEAR)
        vs = cv2.resize(v, (rw, rh), interpolation=cv2.INTER_LINEAR)
    else:  # chroma is at half size already: the blocks of scale/2 (a power of two), ceil(ceil(h/2)/(s/2)) = ceil(h/s)
        us, vs = reduce_exact(u, scale // 2), reduce_exact(v, scale // 2)
    return cv2.transform(cv2.merge([ys, to_8bit(us, bits), to_8bit(vs, bits)]), _matrix(matrix, full_range, color))


def to_8bit(plane: np.ndarray, bits: int) -> np.ndarray:
    """Samples of `bits` bits (10-bit video: 64-940 limited range) as 8-bit codes, rounded: after the reduction,
    so a 1080p picture's 16-bit planes are never shifted at full size."""
    if bits <= 8:
        return plane
    shift = bits - 8
    return ((plane.astype(np.uint32) + (1 << (shift - 1))) >> shift).clip(0, 255).astype(np.uint8)


def rgb_to_yuv420(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An RGB frame (even height and width) as a camera's encoder sees it: BT.601 limited-range 4:2:0 planes."""
    h, w = rgb.shape[:2]
    if h % 2 or w % 2:
        raise ValueError(f"a 4:2:0 frame needs an even size, not {w}x{h}")
    i420 = cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420)
    y = i420[:h]
    chroma = i420[h:].reshape(-1)
    q = (h // 2) * (w // 2)
    return y, chroma[:q].reshape(h // 2, w // 2), chroma[q:].reshape(h // 2, w // 2)


def reduced_yuv_decode(raw: np.ndarray, scale: int, color: str = "rgb") -> np.ndarray:
    """What a video source delivers for this raw frame (in `color`; even size) decoded at 1/scale."""
    rgb = cv2.cvtColor(raw, cv2.COLOR_BGR2RGB) if color == "bgr" else (
        cv2.cvtColor(raw, cv2.COLOR_GRAY2RGB) if raw.ndim == 2 else raw)
    return yuv420_to_frame(*rgb_to_yuv420(rgb), scale, color)


def camera_sized_reduced_yuv(raw: np.ndarray, scale: int, color: str = "rgb") -> np.ndarray:
    """A golden frame as an H.264 camera `scale` times its size delivers it through the reduced video path:
    scaled up (cubic), as 4:2:0 planes, averaged down to 1/scale, converted. The self-test's counterpart of
    jpeg.camera_sized_reduced for video codecs (codec artefacts are the same on both paths: not modelled)."""
    h, w = raw.shape[:2]
    big = cv2.resize(raw, (w * scale, h * scale), interpolation=cv2.INTER_CUBIC)
    if big.shape[0] % 2 or big.shape[1] % 2:
        big = big[: big.shape[0] // 2 * 2, : big.shape[1] // 2 * 2]
    return reduced_yuv_decode(big, scale, color)
