"""The serving side's view of reduced-scale JPEG decoding (the functions live in agent.spec.jpeg, so the
self-test one floor down proves the very path the sources take)."""

from __future__ import annotations

from agent.spec.jpeg import (
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

__all__ = ["SCALES", "camera_sized_reduced", "decode_jpeg", "decode_scale", "imread_flags", "is_jpeg", "jpeg_size",
           "max_decode_scale", "needed_size", "reduced_decode", "scaled_geometry"]
