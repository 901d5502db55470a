"""Checks a source's configuration can pass before anything serves: shared by `run` (opening the source) and
`config check` (which must refuse every config `run` would refuse)."""

from __future__ import annotations

import os
from pathlib import Path

import cv2


PROBE_READS = 64  # reads before a file is refused as decoding nothing: past a damaged first group of pictures


def video_problem(path: Path | None) -> str | None:
    """Why a video file cannot serve, or None: it exists, is a readable file, and FFmpeg decodes a frame of it.
    Opening is not enough: FFmpeg refuses a text file only when asked for a frame on some builds, and a video
    source that ends with no frame would otherwise look like a clean, empty run (exit 0, 0 results)."""
    return probe_video(path)[0]


def probe_video(path: Path | None) -> tuple[str | None, int]:
    """(`video_problem`, the quarter turns counter-clockwise that display the file upright): its display matrix
    as OpenCV reads it, and OpenCV turns the frames it decodes; the PyAV path turns its own to match."""
    if path is None:
        return "source type video needs a path", 0
    if not path.exists():
        return f"{path} does not exist", 0
    if not path.is_file():
        return f"{path} is not a file (a video source reads one video file; a folder of images is type folder)", 0
    if not os.access(path, os.R_OK):
        return f"{path} is not readable by this user", 0
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    try:
        if not cap.isOpened():
            return f"{path} is not a video FFmpeg can open", 0
        # a damaged first keyframe fails the first reads, not the file (a review: 33 frames decoded after it)
        for _ in range(PROBE_READS):
            ok, img = cap.read()
            if ok and img is not None:
                break
        else:
            return (f"{path}: FFmpeg opens it but decodes no frame from its first {PROBE_READS} "
                    f"(empty or damaged)"), 0
        degrees = float(cap.get(cv2.CAP_PROP_ORIENTATION_META) or 0.0)
    finally:
        cap.release()
    return None, round(-degrees / 90) % 4  # OpenCV's degrees turn clockwise
