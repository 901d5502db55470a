"""Checks a source's configuration can pass before anything serves: shared by `run` (opening the source) and
`config check` (which must refuse every config `run` would refuse)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import cv2


PROBE_READS = 3000  # reads, or PROBE_S seconds, before a file is refused as decoding nothing: past a damaged
PROBE_S = 2.0       # first group of pictures (a read at the end of a file returns at once)


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
        # a damaged start fails the first reads, not the file (a review: 33 frames decoded after a zeroed first
        # keyframe; 100 damaged packets decode nothing, about 1 ms each): read on for a while before refusing
        deadline = time.monotonic() + PROBE_S
        reads = 0
        while True:
            ok, img = cap.read()
            reads += 1
            if ok and img is not None:
                break
            if time.monotonic() > deadline or reads >= PROBE_READS:
                return (f"{path}: FFmpeg opens it but decodes no frame from it in {reads} reads "
                        f"(empty or damaged)"), 0
        degrees = float(cap.get(cv2.CAP_PROP_ORIENTATION_META) or 0.0)
    finally:
        cap.release()
    return None, round(-degrees / 90) % 4  # OpenCV's degrees turn clockwise
