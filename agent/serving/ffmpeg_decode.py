"""Video files and network streams through PyAV (FFmpeg's libraries): frames decoded once, converted at the
size the model needs, never at full size in the capture thread.

Why PyAV and not cv2.VideoCapture: OpenCV hands out only a full-size BGR picture (its YUV->BGR conversion
alone costs about as much as the preprocessing), and exposes no scale. Through PyAV the capture thread
keeps the decoder's frame as it is (the 4:2:0 planes, no copy); the preprocessing pool averages the planes
down to 1/scale and converts only the reduced picture (agent/vocabulary/yuv.py). Measured on this 2-core
machine, 1080p H.264, CPU per frame: decode alone 3.6-3.8 ms; cv2.read + BGR->RGB + resize 5.5-7.0 ms;
PyAV + swscale to 1/8 RGB 4.8-5.7 ms; PyAV planes + cv2 area + colour at 1/8 4.5-4.7 ms; an ffmpeg
subprocess with -vf scale (its CPU counted) 5.5 ms, plus a process per camera and a pipe copy per frame.
MJPEG is demuxed here too and its packets handed to libjpeg's reduced decode (agent/vocabulary/jpeg.py).

A stream opened here is opened once: `ffmpeg -listen 1` and many cameras serve one client, so the codec is
learnt from this connection, never probed on another.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.vocabulary.yuv import reduce_exact, yuv420_to_frame

# PyAV is imported on the first video opened (90 ms and 22 MB here): folder, sensor and MQTT agents never pay.
# Without it, video sources fall back to cv2.VideoCapture (full-size BGR).
av: Any = None

MJPEG_CODECS = frozenset({"mjpeg", "jpegls", "ljpeg", "mjpegb"})
# 4:2:0 formats reduced through their planes, and the bits their samples are read at: more than 8, little-endian
# 16-bit words, as this machine reads them. P010 keeps its 10 bits at the top of each word (read as 16).
PLANES_420 = {"yuv420p": 8, "yuvj420p": 8, "nv12": 8, "p010le": 16, "yuv420p10le": 10, "yuv420p12le": 12}
# what hardware decoders hand back: luma, then U and V interleaved at half size
SEMI_PLANAR = frozenset({"nv12", "p010le"})
SIGNATURE_STRIDE = 16  # the frozen-picture check compares every 16th luma sample of every 16th row
_BT709 = 1             # AVCOL_SPC_BT709
_FULL_RANGE = 2        # AVCOL_RANGE_JPEG
# source.hw_decode -> PyAV's hardware device types (FFmpeg hwaccels), or "v4l2m2m": FFmpeg's V4L2
# memory-to-memory decoders (h264_v4l2m2m...), which are codecs of their own, not a hwaccel
HW_DEVICES = {"vaapi": "vaapi", "cuda": "cuda", "drm": "drm", "mfx": "qsv", "d3d11": "d3d11va"}
HW_ANY = ("cuda", "vaapi", "qsv", "d3d11va", "drm")


@dataclass
class DecodeMeter:
    """The capture thread's wall time inside the decoder (sending packets, taking frames: never the wait for
    the network), across reopenings: the stage planner sizes the decoder's threads by it."""

    wait_ns: int = 0
    frames: int = 0
    pixels: int = 0  # the frame size last decoded


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
    av.VideoFrame (other codecs); (False, None) at the end, on a time-out or a lost stream.

    The decoder is a codec context of its own (made from the stream's codec and extradata), so it can be
    replaced while the container stays open: FFmpeg reads a decoder's thread count only when it opens, and
    `request_threads` takes effect at the next keyframe, where the old decoder is drained (every frame it
    holds is delivered) and a new one starts -- no frame lost or repeated, no reconnect (a camera serving one
    client would refuse a second). `hw` (a PyAV device type or "v4l2m2m") is tried on the first packet and
    given up, with the reason in `hw_why`, for software when it cannot decode."""

    def __init__(self, target: str, open_timeout_s: float, read_timeout_s: float, threads: int, live: bool,
                 jpeg_packets: bool = True, hw: str = "none", meter: DecodeMeter | None = None):
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
        self.live = live
        self.meter = meter if meter is not None else DecodeMeter()
        self.meter.pixels = int(ctx.width or 0) * int(ctx.height or 0) or self.meter.pixels
        self.hw = "none"
        self.hw_why = (None if hw == "none" else "JPEG packets are decoded by libjpeg" if self.packets
                       else "not tried yet")
        self._hw_asked = hw
        self.want_threads: int | None = None  # set by another thread; taken at the next keyframe
        self.skipping = False  # frames no other frame references are not decoded while set (`skip_nonref`)
        self.swaps = 0
        self.threads = 0
        self.ctx: Any = None
        if not self.packets:
            self.ctx = self._decoder(threads)
        self._demux = self.container.demux(self.stream)
        self._pending: list[Any] = []
        self.bad = 0  # packets the decoder refused (counted, skipped, as FFmpeg inside OpenCV does)

    def _decoder(self, threads: int, hw: Any = None, codec: str | None = None) -> Any:
        """A new decoder for the stream, opened on its first packet; `threads` 0 is FFmpeg's own choice."""
        stream = self.stream.codec_context
        ctx = av.CodecContext.create(codec or stream.name, "r", hwaccel=hw)
        if stream.extradata:
            ctx.extradata = stream.extradata  # SPS/PPS of an MP4 (avcC), hvcC...
        # Codecs whose packets do not say their size and pixel format (FFV1 version 1, rawvideo) take them from
        # the container: without, every packet was refused and the file served nothing (a review, 7 December).
        if stream.width and stream.height:
            ctx.width, ctx.height = stream.width, stream.height
        if stream.pix_fmt:
            try:
                ctx.pix_fmt = stream.pix_fmt
            except (ValueError, TypeError):
                pass
        ctx.thread_type = "AUTO"  # frame and slice threads, as many as asked
        ctx.thread_count = threads
        self.threads = int(ctx.thread_count)
        if getattr(self, "skipping", False):  # a decoder swapped in while skipping keeps skipping
            ctx.skip_frame = "NONREF"
        return ctx

    def skip_nonref(self, on: bool) -> None:
        """While the consumer is behind (the frame before still waits to be taken), frames that no other frame
        references (B-frames) are not decoded at all: latest-frame-wins would drop them unseen. Reference
        frames are decoded whatever happens (the next ones are built on them), so a stream without B-frames,
        as most cameras send, decodes every frame. Called from the reading thread; software decoding only."""
        if on == self.skipping or self.ctx is None or self.hw != "none":
            return
        try:
            self.ctx.skip_frame = "NONREF" if on else "DEFAULT"
        except (AttributeError, TypeError, ValueError):
            return
        self.skipping = on

    def request_threads(self, threads: int) -> None:
        """Decode with `threads` frame threads from the next keyframe on (the planner's call, any thread)."""
        if not self.packets and self.hw == "none" and threads != self.threads:
            self.want_threads = threads

    def _decode(self, packet: Any) -> list[Any]:
        if self.hw_why == "not tried yet":
            return self._first_hw(packet)
        if self.want_threads is not None and packet.is_keyframe and packet.size:
            # drain the old decoder (its frame threads hold up to `threads` frames), then start the new one here
            drained = list(self.ctx.decode(None))
            self.ctx, self.want_threads = self._decoder(self.want_threads), None
            self.swaps += 1
            return drained + list(self.ctx.decode(packet))
        return list(self.ctx.decode(packet))

    def _first_hw(self, packet: Any) -> list[Any]:
        """Decode the first packet on the device asked for; software, with the reason, when it cannot."""
        soft, threads = self.ctx, self.threads
        frames, self.hw_why = hw_decoder(self, self._hw_asked, packet)
        if frames is None:
            self.ctx, self.threads = soft, threads
            return list(self.ctx.decode(packet))
        return frames

    def read(self) -> tuple[bool, Any]:
        try:
            while not self._pending:
                packet = next(self._demux)
                if self.packets:
                    if packet.size:
                        return True, np.frombuffer(packet, np.uint8)  # no copy: the array holds the packet
                    continue
                t0 = time.perf_counter_ns()
                try:
                    self._pending = self._decode(packet)  # an empty packet at the end flushes the decoder
                except av.error.InvalidDataError:
                    self.bad += packet.size > 0  # the empty flush packet at the end is not a frame refused
                self.meter.wait_ns += time.perf_counter_ns() - t0
        except StopIteration:
            return False, None
        except (av.error.FFmpegError, OSError):  # time-out, connection lost, stream ended badly
            return False, None
        if not self.packets:
            self.meter.frames += 1
        return True, self._pending.pop(0)

    def release(self) -> None:
        try:
            self.container.close()
        except (av.error.FFmpegError, OSError):
            pass


def hw_decoder(reader: AVReader, asked: str, packet: Any) -> tuple[list[Any] | None, str | None]:
    """Try the device `asked` for ("any": each this FFmpeg build knows) on the stream's first packet. ->
    (its frames, None) with `reader.ctx` and `reader.hw` set to the device's decoder, or (None, why not)."""
    from av.codec import hwaccel

    built = list(hwaccel.hwdevices_available())
    tries = ([t for t in HW_ANY if t in built] + ["v4l2m2m"] if asked == "any"
             else ["v4l2m2m"] if asked == "v4l2m2m" else [HW_DEVICES.get(asked, asked)])
    why: list[str] = []
    for kind in tries:
        try:
            if kind == "v4l2m2m":
                name = f"{reader.stream.codec_context.name}_v4l2m2m"
                if name not in av.codecs_available:
                    why.append(f"v4l2m2m: no {name} decoder in this FFmpeg build")
                    continue
                ctx = reader._decoder(0, codec=name)
            elif kind not in built:
                why.append(f"{kind}: not in this FFmpeg build (it has {', '.join(built) or 'none'})")
                continue
            else:
                ctx = reader._decoder(0, hwaccel.HWAccel(device_type=kind, allow_software_fallback=False))
            frames = list(ctx.decode(packet))
        except (av.error.FFmpegError, OSError, RuntimeError, ValueError) as exc:
            why.append(f"{kind}: {type(exc).__name__}: {exc}"[:200])
            continue
        if kind != "v4l2m2m" and not ctx.is_hwaccel:  # FFmpeg opened it but decodes in software
            why.append(f"{kind}: no usable device (FFmpeg fell back to software)")
            continue
        reader.ctx, reader.hw = ctx, kind
        return frames, None
    return None, "; ".join(why) or f"{asked}: nothing to try"


def planes(frame: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4:2:0 frame's Y, U, V planes as views into the decoder's buffers (no copy): planar 8-bit, planar 16-bit
    words (10-bit: uint16 views), or NV12 (U and V as strided views into the interleaved plane)."""
    w, h = frame.width, frame.height
    cw, ch = (w + 1) // 2, (h + 1) // 2
    dtype = _sample_type(frame)
    size = np.dtype(dtype).itemsize

    def view(i: int, pw: int, ph: int) -> np.ndarray:
        p = frame.planes[i]
        return np.frombuffer(p, dtype).reshape(-1, p.line_size // size)[:ph, :pw]

    if frame.format.name in SEMI_PLANAR:
        uv = view(1, 2 * cw, ch)
        return view(0, w, h), uv[:, 0::2], uv[:, 1::2]
    return view(0, w, h), view(1, cw, ch), view(2, cw, ch)


def _sample_type(frame: Any) -> type[np.unsignedinteger]:
    """uint16 where a sample has more than 8 bits (yuv420p10le, P010...: two bytes each), else uint8."""
    comps: Any = getattr(frame.format, "components", None) or ()
    return np.uint16 if comps and comps[0].bits > 8 else np.uint8


def signature(frame: Any) -> np.ndarray:
    """A small sample of the picture for the frozen check: every 16th luma sample of every 16th row (8 kB at
    1080p, against 6 MB for the full frame), copied: the decoder reuses its buffers."""
    p = frame.planes[0]
    dtype = _sample_type(frame)  # bytes of 10-bit samples would sample half the picture
    y = np.frombuffer(p, dtype).reshape(-1, p.line_size // dtype().itemsize)[: frame.height, : frame.width]
    return y[::SIGNATURE_STRIDE, ::SIGNATURE_STRIDE].copy()


def to_frame(frame: Any, scale: int, color: str, turns: int = 0) -> np.ndarray:
    """A decoded frame -> the bundle's frame at 1/scale in `color`, turned `turns` quarter turns counter-clockwise
    (the stream's display matrix: our own decoder's frames do not carry it). At full size FFmpeg's own conversion
    (swscale), the picture cv2.VideoCapture gives; reduced, the planes of the 4:2:0 formats in `PLANES_420` (8- and
    10-bit, NV12 and P010 from hardware decoders) averaged down first (agent/vocabulary/yuv.py). Other formats (4:2:2,
    4:4:4) are converted at full size, then reduced: swscale's own reduced conversion of them differed from the
    full picture by up to 255 on colour edges."""
    fmt = frame.format.name
    if scale == 1 or fmt not in PLANES_420:
        img = reduce_exact(frame.to_ndarray(format={"rgb": "rgb24", "bgr": "bgr24", "gray": "gray"}[color]), scale)
    else:
        full = fmt == "yuvj420p" or frame.color_range == _FULL_RANGE
        img = yuv420_to_frame(*planes(frame), scale, color, "bt709" if frame.colorspace == _BT709 else "bt601", full,
                              PLANES_420[fmt])
    return upright(img, turns)


def upright(img: np.ndarray, turns: int) -> np.ndarray:
    """A picture turned `turns` quarter turns counter-clockwise (contiguous: OpenCV takes it next)."""
    return np.ascontiguousarray(np.rot90(img, turns)) if turns else img


def displayed(size: tuple[int, int], turns: int) -> tuple[int, int]:
    """A (height, width) as displayed after `turns` quarter turns."""
    return (size[1], size[0]) if turns % 2 else size


def frame_size(frame: Any, turns: int = 0) -> tuple[int, int]:
    """(height, width) as displayed: a stream turned a quarter turn is served upright."""
    return displayed((int(frame.height), int(frame.width)), turns)
