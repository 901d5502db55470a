"""Video files and network streams through PyAV (FFmpeg's libraries): frames decoded once, converted at the
size the model needs, never at full size in the capture thread.

Why PyAV and not cv2.VideoCapture: OpenCV hands out only a full-size BGR picture (its YUV->BGR conversion
alone costs about as much as the preprocessing), and exposes no scale. Through PyAV the capture thread
keeps the decoder's frame as it is (the 4:2:0 planes, no copy); the preprocessing pool averages the planes
down to 1/scale and converts only the reduced picture (agent/spec/yuv.py). Measured on this 2-core
machine, 1080p H.264, CPU per frame: decode alone 3.6-3.8 ms; cv2.read + BGR->RGB + resize 5.5-7.0 ms;
PyAV + swscale to 1/8 RGB 4.8-5.7 ms; PyAV planes + cv2 area + colour at 1/8 4.5-4.7 ms; an ffmpeg
subprocess with -vf scale (its CPU counted) 5.5 ms, plus a process per camera and a pipe copy per frame.
MJPEG is demuxed here too and its packets handed to libjpeg's reduced decode (agent/spec/jpeg.py).

A stream opened here is opened once: `ffmpeg -listen 1` and many cameras serve one client, so the codec is
learnt from this connection, never probed on another.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import numpy as np

from agent.spec.yuv import yuv420_to_frame

# PyAV is imported on the first video opened (90 ms and 22 MB here): folder, sensor and MQTT agents never pay.
# Without it, video sources fall back to cv2.VideoCapture (full-size BGR).
av: Any = None

MJPEG_CODECS = frozenset({"mjpeg", "jpegls", "ljpeg", "mjpegb"})
YUV420 = frozenset({"yuv420p", "yuvj420p"})
SIGNATURE_STRIDE = 16  # the frozen-picture check compares every 16th luma sample of every 16th row
_BT709 = 1             # AVCOL_SPC_BT709
_FULL_RANGE = 2        # AVCOL_RANGE_JPEG


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("av") is not None


def _av() -> Any:
    global av
    if av is None:
        import av as lib
        import av.error  # the error classes are a submodule

        av = lib
    return av


class AVReader:
    """One opened file or stream. `read()` -> (True, item): a JPEG packet (uint8 array, MJPEG) or a decoded
    av.VideoFrame (other codecs); (False, None) at the end, on a time-out or a lost stream."""

    def __init__(self, target: str, open_timeout_s: float, read_timeout_s: float, threads: int, live: bool,
                 jpeg_packets: bool = True):
        # RTSP: TCP (as behind NAT); no probing beyond the SDP's parameter sets: FFmpeg's default probe buffered
        # 2.8 s of frames at open here (stale the moment they are served, and a slower reconnect)
        options = ({"rtsp_transport": "tcp", "analyzeduration": "0", "probesize": "32768"}
                   if target.startswith("rtsp") else {})
        lib = _av()
        try:
            self.container = lib.open(target, options=options, timeout=(open_timeout_s, read_timeout_s))
        except lib.error.FFmpegError as exc:
            raise OSError(f"{target}: {exc}") from exc
        try:
            self.stream = self.container.streams.video[0]
        except IndexError:
            self.container.close()
            raise ValueError(f"{target}: no video stream") from None
        ctx = self.stream.codec_context
        tag = str(ctx.codec_tag or "").strip("\x00 ")
        # the FourCC where the container has one, as OpenCV reports it (MJPG for an HTTP MJPEG stream too)
        self.codec = tag if tag.isprintable() and tag else ("MJPG" if ctx.name == "mjpeg" else ctx.name)
        self.packets = jpeg_packets and ctx.name in MJPEG_CODECS  # False: FFmpeg decodes MJPEG too
        if not self.packets:
            self.stream.thread_type = "AUTO"  # frame and slice threads, as many as asked (0: FFmpeg's choice)
            ctx.thread_count = threads
        self.threads = int(ctx.thread_count)
        self.live = live
        self._demux = self.container.demux(self.stream)
        self._pending: list[Any] = []
        self.bad = 0  # packets the decoder refused (counted, skipped, as FFmpeg inside OpenCV does)

    def read(self) -> tuple[bool, Any]:
        try:
            while not self._pending:
                packet = next(self._demux)
                if self.packets:
                    if packet.size:
                        return True, np.frombuffer(packet, np.uint8)  # no copy: the array holds the packet
                    continue
                try:
                    self._pending = list(packet.decode())  # an empty packet at the end flushes the decoder
                except av.error.InvalidDataError:
                    self.bad += 1
        except StopIteration:
            return False, None
        except (av.error.FFmpegError, OSError):  # time-out, connection lost, stream ended badly
            return False, None
        return True, self._pending.pop(0)

    def release(self) -> None:
        try:
            self.container.close()
        except (av.error.FFmpegError, OSError):
            pass


def planes(frame: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4:2:0 frame's Y, U, V planes as views into the decoder's buffers (no copy)."""
    w, h = frame.width, frame.height
    out = []
    for i, (pw, ph) in enumerate(((w, h), ((w + 1) // 2, (h + 1) // 2), ((w + 1) // 2, (h + 1) // 2))):
        p = frame.planes[i]
        out.append(np.frombuffer(p, np.uint8).reshape(-1, p.line_size)[:ph, :pw])
    return out[0], out[1], out[2]


def signature(frame: Any) -> np.ndarray:
    """A small sample of the picture for the frozen check: every 16th luma sample of every 16th row (8 kB at
    1080p, against 6 MB for the full frame), copied: the decoder reuses its buffers."""
    p = frame.planes[0]
    y = np.frombuffer(p, np.uint8).reshape(-1, p.line_size)[: frame.height, : frame.width]
    return y[::SIGNATURE_STRIDE, ::SIGNATURE_STRIDE].copy()


def to_frame(frame: Any, scale: int, color: str) -> np.ndarray:
    """A decoded frame -> the bundle's frame at 1/scale in `color`. At full size FFmpeg's own conversion
    (swscale), the picture cv2.VideoCapture gives; reduced, the planes averaged down first (agent/spec/yuv.py);
    formats other than 4:2:0 through swscale at the reduced size."""
    fmt = frame.format.name
    if scale == 1 or fmt not in YUV420:
        out = {"rgb": "rgb24", "bgr": "bgr24", "gray": "gray"}[color]
        if scale == 1:
            return frame.to_ndarray(format=out)
        h, w = -(-frame.height // scale), -(-frame.width // scale)
        return frame.to_ndarray(width=w, height=h, format=out, interpolation="AREA")
    full = fmt == "yuvj420p" or frame.color_range == _FULL_RANGE
    return yuv420_to_frame(*planes(frame), scale, color, "bt709" if frame.colorspace == _BT709 else "bt601", full)


def frame_size(frame: Any) -> tuple[int, int]:
    return int(frame.height), int(frame.width)
