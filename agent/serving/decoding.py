"""The serving side's view of reduced-scale decoding: JPEG at 1/2, 1/4, 1/8 inside libjpeg (agent.vocabulary.jpeg),
and video codecs' 4:2:0 planes reduced before the colour conversion (agent.vocabulary.yuv). The functions live in
agent.vocabulary, so the self-test one floor down proves the very paths the sources take:
`camera_sized_reduced` for JPEG cameras, `camera_sized_reduced_yuv` for H.264/H.265 cameras."""

from __future__ import annotations

from agent.vocabulary.jpeg import (
    SCALES,
    camera_sized_reduced,
    decode_jpeg,
    decode_scale,
    imread_flags,
    is_jpeg,
    jpeg_size,
    max_decode_scale,
    needed_size,
    reduced_decode,
    scaled_geometry,
)
from agent.vocabulary.yuv import camera_sized_reduced_yuv, reduced_yuv_decode, yuv420_to_frame

__all__ = ["SCALES", "camera_sized_reduced", "camera_sized_reduced_yuv", "decode_jpeg", "decode_scale", "imread_flags",
           "is_jpeg", "jpeg_size", "max_decode_scale", "needed_size", "reduced_decode", "reduced_yuv_decode",
           "scaled_geometry", "yuv420_to_frame"]
