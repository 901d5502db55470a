"""Frame sources, chosen by type from a registry: image folders, OpenCV video/camera/streams, sensor windows.

Each source delivers frames in the bundle's frame contract (image colour order, sensor window shape),
never blocks past its time-outs, reports its state, and turns a lost stream into a reconnect with backoff.
A frame that cannot be decoded is raised as BadFrame: the pipeline counts it and carries on.
JPEG frames (MJPEG streams and videos, .jpg folders, mqtt images) are decoded by libjpeg at the smallest
scale the bundle's resize allows, straight into the bundle's colours; other codecs (H.264, H.265...) are
decoded by FFmpeg through PyAV, and their 4:2:0 planes reduced to that scale before the colour conversion
(agent/serving/ffmpeg_decode.py). Either way the decode or conversion is left to the first reader of
`Frame.data` (the preprocessing pool, not the capture thread). Without PyAV, or for cameras (V4L2) and
hardware decoding, cv2.VideoCapture decodes at full size.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import cv2
import numpy as np

from agent.config import SourceConfig
from agent.source_types import (CameraSourceConfig, FfmpegKeys, FolderSourceConfig, MqttSourceConfig, PictureKeys,
                                StreamSourceConfig, VideoSourceConfig)
from agent.source_types.registry import register as register_type
from agent.source_types.registry import unregister as unregister_type
from agent.errors import BadFrame, ConfigError, UndecodableFrame
from agent.logsetup import get_logger
from agent.npio import read_npy
from agent.serving import ffmpeg_decode
from agent.serving.decoding import decode_jpeg, decode_scale, is_jpeg, jpeg_size
from agent.serving.capabilities import Retargetable, inner_sources
from agent.serving.sizing import DecoderLoad
from agent.serving.source_checks import probe_video
from agent.spec.jpeg import MJPEG_FOURCCS
from agent.spec.yuv import reduced_size
from agent.spec.manifest import FrameSpec, ResizeSpec
from agent.spec.preprocess import IMAGE_SUFFIXES, bgr_to_frame, imread_flag, read_image_file

log = get_logger("source")

JPEG_SUFFIXES = (".jpg", ".jpeg")
HW_DECODE = {"none": cv2.VIDEO_ACCELERATION_NONE, "any": cv2.VIDEO_ACCELERATION_ANY,
             "vaapi": cv2.VIDEO_ACCELERATION_VAAPI, "d3d11": cv2.VIDEO_ACCELERATION_D3D11,
             "mfx": cv2.VIDEO_ACCELERATION_MFX, "drm": cv2.VIDEO_ACCELERATION_DRM}


def _released(_: Any) -> np.ndarray:
    raise RuntimeError("this frame's pixels were released once its model input was made (Frame.release): "
                       "read what you need before preprocessing")


class Frame:
    """One captured frame. `data` is in the bundle's frame contract.

    `scale` > 1: decoded at 1/scale of the camera's frame (map boxes back with decoding.scaled_geometry).
    `item`: with many sources, `source` is the source's name and `item` what that source called the frame.
    `convert`: a colour conversion still owed, done once on the first read of `data` -- by the
    preprocessing stage, so the capture thread never converts a full frame.
    """

    __slots__ = ("index", "_data", "captured_at", "captured_ns", "source", "scale", "_convert", "item", "full")

    def __init__(self, index: int, data: np.ndarray, captured_at: float, captured_ns: int, source: str,
                 scale: int = 1, convert: Callable[[np.ndarray], np.ndarray] | None = None,
                 full: tuple[int, int] | None = None):
        self.index = index
        self._data: Any = data  # pixels, an encoded packet or a decoder frame still to convert; None once released
        self.captured_at = captured_at  # wall clock, for results
        self.captured_ns = captured_ns  # monotonic, for latency
        self.source = source
        self.scale = scale
        self._convert = convert
        self.item: str | None = None  # within a named source of many: the file the frame came from
        self.full = full  # the camera frame's (height, width) where a reduced decode knows it (boxes clip to it)

    @property
    def data(self) -> np.ndarray:
        if self._convert is not None:
            self._data, self._convert = self._convert(self._data), None
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data, self._convert = value, None

    def release(self) -> None:
        """Drop the pixels once the model's input is made: a full-size decoded frame (6 MB at 1080p) is then not
        held while the model runs and the result waits its turn to be published. Reading `data` after raises."""
        self._data, self._convert = None, _released

    def __repr__(self) -> str:
        data: Any = self._data
        shape = None if data is None else getattr(data, "shape", None) or (data.height, data.width)  # av.VideoFrame
        return (f"Frame(index={self.index}, source={self.source!r}, shape={shape}, scale={self.scale}, "
                f"converted={self._convert is None}{', released' if self._convert is _released else ''})")


@dataclass
class SourceStats:
    state: str = "starting"  # starting | open | lost | frozen | ended
    frames: int = 0
    bad: int = 0
    reconnects: int = 0
    losses: int = 0
    frozen_events: int = 0
    last_frame_ns: int = 0
    last_error: str | None = None
    heartbeat: float = field(default_factory=time.monotonic)  # the source's loop is alive (watchdog)
    # how frames are decoded, for health: path (jpeg | ffmpeg | image | none), codec, scale, threads, hw
    decoder: dict[str, Any] = field(default_factory=dict)
    cpu_ns: int = 0      # CPU time of the reads that delivered frames (the pipeline sizes its stages by it)
    cpu_frames: int = 0

    def beat(self) -> None:
        self.heartbeat = time.monotonic()


CAPTURE_THREAD = "capture"  # the name every thread that reads a source starts with (the pipeline's, one per source)


def reads_in_flight() -> list[str]:
    """The capture threads still alive, each inside a source's read that its stop could not end (a stuck
    camera). Interpreter teardown must not run under such a read: FFmpeg's interrupt callback in PyAV takes
    the GIL every ~100 ms, and once teardown has freed the thread's state that is a use after free (an agent
    ended -11 on SIGTERM with a stuck camera). The CLI ends the process with os._exit when this is not empty."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(CAPTURE_THREAD) and t.is_alive())


class FrameSource(Protocol):
    name: str
    live: bool

    @property
    def stats(self) -> SourceStats: ...

    def read(self, stop: threading.Event) -> Frame | None:
        """The next frame; None when the source has ended for good or `stop` is set. May raise BadFrame."""

    def close(self) -> None: ...


def _now() -> tuple[float, int]:
    return time.time(), time.perf_counter_ns()


class _Pacer:
    def __init__(self, max_fps: float):
        self.period = 1.0 / max_fps if max_fps > 0 else 0.0
        self.next = time.monotonic()

    def wait(self, stop: threading.Event, stats: "SourceStats") -> None:
        if self.period:
            while not stop.is_set() and (delay := self.next - time.monotonic()) > 0:
                stats.beat()  # a slow pace is not a hang
                stop.wait(min(delay, 1.0))
            self.next = max(self.next + self.period, time.monotonic())


OpenCVConfig = VideoSourceConfig | CameraSourceConfig | StreamSourceConfig  # the types OpenCVSource opens


class FolderSource:
    """Image files in name order; the demo's default source."""

    live = False

    def __init__(self, cfg: FolderSourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None,
                 max_scale: int = 8):
        if cfg.path is None or not cfg.path.is_dir():
            raise ConfigError(f"source.path: {cfg.path} is not a directory of images")
        self.files = sorted(p for p in cfg.path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.files:
            raise ConfigError(f"source.path: {cfg.path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        self.cfg, self.frame, self.resize, self.max_scale = cfg, frame, resize, max_scale
        self.name = cfg.name or f"folder:{cfg.path}"
        self.pos = 0
        self.stats = SourceStats(state="open", decoder={"path": "image", "scale": 1})
        self.pacer = _Pacer(cfg.max_fps)

    def read(self, stop: threading.Event) -> Frame | None:
        self.stats.beat()
        if stop.is_set():
            return None
        if self.pos >= len(self.files):
            if not self.cfg.loop:
                self.stats.state = "ended"
                return None
            self.pos = 0
        self.pacer.wait(stop, self.stats)
        path = self.files[self.pos]
        self.pos += 1
        scale, full = 1, None
        if path.suffix.lower() in JPEG_SUFFIXES and self.frame.kind == "image":
            data, scale, full = _decode_jpeg_frame(np.fromfile(path, np.uint8), self.cfg, self.frame, self.resize,
                                                   self.max_scale, self.stats, self.name)
        else:
            data = read_image_file(str(path), self.frame)
        if data is None:
            self.stats.bad += 1
            raise BadFrame(f"{path}: cannot decode image")
        at, ns = _now()
        self.stats.frames += 1
        self.stats.last_frame_ns = ns
        return Frame(self.stats.frames, data, at, ns, str(path.name), scale, full=full)

    def close(self) -> None:
        pass


class OpenCVSource:
    """Video files, cameras and network streams through cv2.VideoCapture, with time-outs and reconnects."""

    def __init__(self, cfg: OpenCVConfig, frame: FrameSpec, resize: ResizeSpec | None = None, max_scale: int = 8):
        self.cfg, self.frame, self.resize, self.max_scale = cfg, frame, resize, max_scale
        self.turns = 0  # quarter turns that display a file's frames upright (streams are not asked)
        if isinstance(cfg, VideoSourceConfig):
            why, self.turns = probe_video(cfg.path)
            if why is not None:  # missing, unreadable or not a video: refused now
                raise ConfigError(f"source.path: {why}")
            if self.turns:
                log.info("source.rotated", source=str(cfg.path), degrees_counter_clockwise=90 * self.turns)
            self.target: str | int = str(cfg.path)
        elif isinstance(cfg, CameraSourceConfig):
            dev = cfg.device or "0"
            self.target = int(dev) if dev.isdigit() else dev
        else:
            if not cfg.url:
                raise ConfigError("source.url: a stream source needs a URL (http://.../mjpeg, rtsp://...)")
            self.target = cfg.url
        self.live = cfg.type != "video"
        self.name = cfg.name or f"{cfg.type}:{self.target}"
        self.stats = SourceStats()
        self.cap: Any = None  # a cv2.VideoCapture, or an ffmpeg_decode.AVReader (PyAV)
        self.av = False       # decoding through PyAV: frames come as av.VideoFrames, reduced on first read
        self.packets = False  # reading encoded JPEG packets (CAP_PROP_FORMAT -1) and decoding them ourselves
        self.packets_usable = frame.kind == "image"  # cleared when the backend hands out something else
        self.backoff = cfg.reconnect_initial_s
        self.prev: np.ndarray | None = None  # the previous frame's signature (frozen-picture check)
        self.same = 0
        self.pacer = _Pacer(cfg.max_fps if isinstance(cfg, VideoSourceConfig) else 0.0)
        # 0: the default (PyAV: min(cores, 2) frame threads at open; a MultiSource shares the cores among its
        # streams), until the stage planner measures the decoder and plans its threads (`plan_decoder`)
        self.decoder_threads = cfg.decoder_threads
        self.open_threads = 0  # not configured: what the decoder opens with (the share, then the planner's count)
        self.decode_meter = ffmpeg_decode.DecodeMeter()
        self.hw_gave_up: str | None = None  # why the device asked for could not decode: not tried again
        self.av_refused: str | None = None  # PyAV decoded nothing of this file: OpenCV's FFmpeg reads it instead
        self._av_bad = 0  # the reader's refused packets already counted in stats.bad

    def _use_av(self) -> bool:
        """PyAV for files and streams (hardware decoding through PyAV's hwaccel too); V4L2 cameras stay with OpenCV."""
        return (ffmpeg_decode.available() and not isinstance(self.target, int) and self.frame.kind == "image"
                and self.av_refused is None)

    def _open_av(self) -> bool:
        threads = self.decoder_threads or self.open_threads or min(len(os.sched_getaffinity(0)), 2)
        try:
            reader = ffmpeg_decode.AVReader(str(self.target), self.cfg.open_timeout_ms / 1000,
                                            self.cfg.read_timeout_ms / 1000, threads, self.live,
                                            jpeg_packets=self.packets_usable,
                                            hw="none" if self.hw_gave_up else self.cfg.hw_decode,
                                            meter=self.decode_meter)
        except (OSError, ValueError) as exc:
            self.stats.last_error = f"cannot open: {exc}"[:300]
            return False
        self.cap, self.av = reader, True
        self._av_bad = 0
        self.packets = reader.packets
        self.stats.decoder = {
            **{k: v for k, v in self.stats.decoder.items() if k.startswith("threads_")},  # the plan outlives a reopen
            "path": "jpeg" if self.packets else "ffmpeg", "codec": reader.codec, "deferred": True,
            # a file's rewind keeps its scale: logged when it changes, not at every loop
            "scale": self.stats.decoder.get("scale", 1), "reduce": self.stats.decoder.get("reduce"),
            "binding": "pyav", "threads": reader.threads, "hw": reader.hw, "hw_requested": self.cfg.hw_decode,
            "hw_fallback": self.hw_gave_up or reader.hw_why,
        }
        return True

    def _after_av_read(self, reader: ffmpeg_decode.AVReader) -> None:
        """What the decoder's first packet (a device tried) or a keyframe (a new thread count) changed."""
        d = self.stats.decoder
        if d.get("hw_fallback") == "not tried yet" and reader.hw_why != "not tried yet":
            self.stats.decoder = {**d, "hw": reader.hw, "hw_fallback": reader.hw_why, "threads": reader.threads}
            if reader.hw_why is not None:
                self.hw_gave_up = reader.hw_why
                log.warning("source.hw_decode_unavailable", source=self.name, requested=self.cfg.hw_decode,
                            codec=reader.codec, reason=reader.hw_why, decoding="software")
        if d.get("threads") != reader.threads and reader.swaps:
            log.info("source.decoder_threads_changed", source=self.name, threads=reader.threads,
                     was=d.get("threads"), at_frame=self.stats.frames + 1,
                     reason=d.get("threads_why"))
            self.stats.decoder = {**self.stats.decoder, "threads": reader.threads}

    def decoder_load(self, since: tuple[int, int] = (0, 0)) -> DecoderLoad | None:
        """This source's decoder over the frames since `since` (a `decode_meter` reading), for the planner;
        None when FFmpeg does not decode its frames in threads of its own (JPEG packets, OpenCV, nothing read)."""
        m = self.decode_meter
        frames = m.frames - since[1]
        if not self.av or self.packets or frames <= 0 or not self.stats.decoder.get("threads"):
            return None
        return DecoderLoad(self.name, int(self.stats.decoder["threads"]), (m.wait_ns - since[0]) / 1e6 / frames,
                           m.pixels, fixed=self.decoder_threads > 0, hw=self.stats.decoder.get("hw", "none") != "none")

    def plan_decoder(self, threads: int, why: str) -> None:
        """The planner's thread count: taken by the decoder at its next keyframe, and by every reopen after."""
        self.stats.decoder = {**self.stats.decoder, "threads_planned": threads, "threads_why": why}
        if self.decoder_threads or threads == self.stats.decoder.get("threads"):
            return
        self.open_threads = threads
        reader = self.cap
        if isinstance(reader, ffmpeg_decode.AVReader):
            reader.request_threads(threads)

    def _open(self) -> bool:
        if self._use_av():
            return self._open_av()
        self.av = False
        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, self.cfg.open_timeout_ms,
                  cv2.CAP_PROP_READ_TIMEOUT_MSEC, self.cfg.read_timeout_ms]
        if self.decoder_threads:
            params += [cv2.CAP_PROP_N_THREADS, self.decoder_threads]
        api = cv2.CAP_V4L2 if isinstance(self.target, int) else cv2.CAP_FFMPEG
        cap = None
        if self.cfg.hw_decode != "none":
            accel = HW_DECODE.get(self.cfg.hw_decode, cv2.VIDEO_ACCELERATION_ANY)  # cuda, v4l2m2m: PyAV's names
            cap = cv2.VideoCapture(self.target, api, params + [cv2.CAP_PROP_HW_ACCELERATION, accel])
            if not cap.isOpened():  # no such device or driver here: decode in software rather than not at all
                cap.release()
                cap = None
        if cap is None:
            cap = cv2.VideoCapture(self.target, api, params)
        if not cap.isOpened():
            cap.release()
            return False
        self.cap = cap
        fourcc = int(cap.get(cv2.CAP_PROP_FOURCC)).to_bytes(4, "little").decode("latin-1").strip("\x00 ")
        # MJPEG: take the encoded frame and let libjpeg decode it at reduced scale into the bundle's colours
        self.packets = (self.packets_usable and fourcc in MJPEG_FOURCCS and api == cv2.CAP_FFMPEG
                        and cap.set(cv2.CAP_PROP_FORMAT, -1))
        hw = int(cap.get(cv2.CAP_PROP_HW_ACCELERATION))
        self.stats.decoder = {
            "path": "jpeg" if self.packets else "ffmpeg", "codec": fourcc, "scale": 1, "pyav_refused": self.av_refused,
            # JPEG decoding waits for the first reader of Frame.data: the preprocessing pool, which decodes
            # on as many cores as the pipeline sizes it to (capture is one thread per source)
            "deferred": self.packets,
            "threads": int(cap.get(cv2.CAP_PROP_N_THREADS)),
            "hw": next((k for k, v in HW_DECODE.items() if v == hw and k != "any"), str(hw)),
            "hw_requested": self.cfg.hw_decode,
        }
        if self.cfg.hw_decode != "none" and hw == cv2.VIDEO_ACCELERATION_NONE:
            log.warning("source.hw_decode_unavailable", source=self.name, requested=self.cfg.hw_decode, codec=fourcc)
        return True

    def _lose(self, why: str) -> None:
        if self.stats.state != "lost":
            self.stats.losses += 1
            log.warning("source.lost", source=self.name, reason=why, losses=self.stats.losses)
        self.stats.state = "lost"
        self.stats.last_error = why
        if self.cap is not None:
            self.cap.release()
            self.cap = None

    def _reconnect(self, stop: threading.Event) -> bool:
        """Open (again), sleeping with exponential backoff between tries; False only when stopped."""
        first = self.stats.state == "starting"
        while not stop.is_set():
            if self._open():
                if not first:
                    self.stats.reconnects += 1
                    log.info("source.reopened", source=self.name, reconnects=self.stats.reconnects)
                self.stats.state = "open"
                self.stats.last_frame_ns = time.perf_counter_ns()
                self.backoff = self.cfg.reconnect_initial_s
                return True
            self._lose("cannot open")
            if not self.live:
                return False
            # equal jitter: a fleet of cameras that lost one network does not reconnect in lock-step
            until = time.monotonic() + self.backoff * random.uniform(0.5, 1.0)
            while not stop.is_set() and time.monotonic() < until:  # beat while waiting: waiting is not hanging
                self.stats.beat()
                stop.wait(min(1.0, until - time.monotonic()))
            self.backoff = min(self.backoff * 2, self.cfg.reconnect_max_s)
        return False

    def read(self, stop: threading.Event) -> Frame | None:
        while not stop.is_set():
            self.stats.beat()
            if self.cap is None and not self._reconnect(stop):
                if not self.live:
                    self.stats.state = "ended"
                return None
            assert self.cap is not None
            self.pacer.wait(stop, self.stats)
            ok, img = self.cap.read()
            if self.av:
                self._count_refused(self.cap)
            if not ok and self.av and not self.live and not self.stats.frames and self.cap.bad:
                # every packet refused, not one frame: cv2.VideoCapture (which the boot's check opened the file
                # with) reads it instead of a clean, empty run
                self.av_refused = f"PyAV's decoder refused all {self.cap.bad} packets"
                log.warning("source.pyav_refused", source=self.name, codec=self.stats.decoder.get("codec"),
                            reason=self.av_refused, decoding="opencv")
                self.close()
                self.stats.bad = 0
                self.stats.state = "starting"  # a change of decoder, not a lost source: no reconnect counted
                continue
            if ok and self.packets and not is_jpeg(img):  # the backend gave something else: decode with FFmpeg
                log.warning("source.not_jpeg_packets", source=self.name, codec=self.stats.decoder.get("codec"))
                self.packets_usable = False
                self.close()
                continue
            if not ok or img is None:
                if not self.live:
                    if isinstance(self.cfg, VideoSourceConfig) and self.cfg.loop and self.stats.frames > 0:
                        self._rewind()
                        continue
                    self.stats.state = "ended"
                    return None
                self._lose("read failed or timed out")
                continue
            at, ns = _now()
            if self.live and self.stats.last_frame_ns and ns - self.stats.last_frame_ns > self.cfg.stall_timeout_s * 1e9:
                log.warning("source.stalled", source=self.name, seconds=(ns - self.stats.last_frame_ns) / 1e9)
            self.stats.last_frame_ns = ns
            # on the encoded packet when there is one (smaller than the picture), else on a small sample,
            # copied (a strided view would keep the previous full frame alive after the pipeline dropped it)
            self._watch_frozen(img if self.packets else
                               ffmpeg_decode.signature(img) if self.av else img[::16, ::16].copy())
            if self.packets:  # decoded by the preprocessing pool (a frame dropped as stale never is)
                turns, size = self.turns, jpeg_size(img)
                size = None if size is None else ffmpeg_decode.displayed(size, turns)
                scale = _jpeg_scale(img, self.cfg, self.resize, self.max_scale, self.stats, self.name, size, turns)
                self.stats.frames += 1
                return Frame(self.stats.frames, img, at, ns, self.name, scale,
                             functools.partial(self._decode, scale=scale, turns=turns), size)
            self.stats.frames += 1
            if self.av:  # the planes reduced and converted by the preprocessing pool
                self._after_av_read(self.cap)
                scale = self._video_scale(img)
                return Frame(self.stats.frames, img, at, ns, self.name, scale,
                             functools.partial(self._convert, scale=scale, turns=self.turns),
                             ffmpeg_decode.frame_size(img, self.turns))
            return Frame(self.stats.frames, img, at, ns, self.name, 1, self._to_frame)
        return None

    def skip_nonref(self, on: bool) -> None:
        """Frames no other references are not decoded while `on` (the reader's consumer is behind): PyAV only."""
        if self.av and not self.packets and self.cap is not None:
            self.cap.skip_nonref(on)

    def _count_refused(self, reader: ffmpeg_decode.AVReader) -> None:
        """Packets the decoder refused (skipped, as FFmpeg inside OpenCV does) are bad frames: counted in health,
        logged at the 1st, 10th, 100th..."""
        new = reader.bad - self._av_bad
        if new <= 0:
            return
        self._av_bad = reader.bad
        before = self.stats.bad
        self.stats.bad += new
        if len(str(self.stats.bad)) > len(str(before)) or before == 0:
            log.warning("source.packets_refused", source=self.name, bad=self.stats.bad,
                        codec=self.stats.decoder.get("codec"), detail="the decoder refused these packets: skipped")

    def _rewind(self) -> None:
        if self.av:  # reopening a file costs less than a seek and a decoder flush
            self.cap.release()
            self.cap = None
            if not self._open_av():
                self._lose("cannot reopen")
            return
        self.cap.set(cv2.CAP_PROP_POS_FRAMES, 0)

    def _video_scale(self, img: Any) -> int:
        """The scale to reduce this decoded frame to (recorded in the source's stats when it changes)."""
        h, w = ffmpeg_decode.frame_size(img, self.turns)
        scale, lowered = _scale_for(self.cfg, self.resize, h, w, self.max_scale, self.turns)
        if self.stats.decoder.get("scale") != scale:
            _log_scale(self.name, scale, (h, w), lowered, self.cfg, codec=self.stats.decoder.get("codec"))
            self.stats.decoder = {**self.stats.decoder, "scale": scale, "reduce": "yuv-planes" if scale > 1 else None,
                                  "lowered_from": lowered}
        return scale

    def _convert(self, img: Any, scale: int, turns: int = 0) -> np.ndarray:
        return ffmpeg_decode.to_frame(img, scale, self.frame.color, turns)

    def _to_frame(self, img: np.ndarray) -> np.ndarray:
        return bgr_to_frame(img, self.frame)

    def _decode(self, packet: np.ndarray, scale: int, turns: int = 0) -> np.ndarray:
        img = decode_jpeg(packet, self.frame.color, scale)
        if img is None:
            self.stats.bad += 1
            raise UndecodableFrame(f"{self.name}: a JPEG frame of {packet.size} bytes does not decode")
        return ffmpeg_decode.upright(img, turns)

    def _watch_frozen(self, img: np.ndarray) -> None:
        if self.prev is not None and self.prev.shape == img.shape and np.array_equal(self.prev, img):
            self.same += 1
            if self.same == self.cfg.frozen_after:
                self.stats.state = "frozen"
                self.stats.frozen_events += 1
                log.warning("source.frozen", source=self.name, identical_frames=self.same)
        else:
            if self.stats.state == "frozen":
                log.info("source.unfrozen", source=self.name)
            if self.stats.state in ("frozen", "starting"):
                self.stats.state = "open"
            self.same = 0
        self.prev = img

    def close(self) -> None:
        if self.cap is not None:
            self.cap.release()
            self.cap = None


class MqttFrameSource:
    """Frames published on an MQTT topic: encoded images, `.npy` arrays, or raw bytes of the frame.

    Latest-frame-wins by default (a small buffer of the newest payloads); a payload that does not
    decode into the bundle's frame is counted and skipped.
    """

    live = True

    def __init__(self, cfg: MqttSourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None, max_scale: int = 8):
        import paho.mqtt.client as paho

        if not cfg.topic:
            raise ConfigError("source.topic: an mqtt source needs the topic frames arrive on")
        if frame.kind == "sensor" and frame.stateful:
            from agent.serving.sensors import mqtt_stateful_message

            raise ConfigError(mqtt_stateful_message())
        self.cfg, self.frame, self.resize, self.max_scale = cfg, frame, resize, max_scale
        self.name = cfg.name or f"mqtt:{cfg.host}:{cfg.port or 1883}/{cfg.topic}"
        self.stats = SourceStats()
        self._buf: deque[tuple[bytes, float, int]] = deque(maxlen=8)
        self._cond = threading.Condition()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self._topic = cfg.topic
        self.client.reconnect_delay_set(int(max(cfg.reconnect_initial_s, 1)), int(cfg.reconnect_max_s))
        self.client.connect_async(cfg.host, cfg.port or 1883, 30)
        self.client.loop_start()
        self.stats.state = "open"

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if not rc.is_failure:
            client.subscribe(self._topic, qos=0)

    def _on_message(self, client: object, userdata: object, msg: object) -> None:
        at, ns = _now()
        with self._cond:
            self._buf.append((msg.payload, at, ns))  # type: ignore[attr-defined]
            self._cond.notify()

    def _decode(self, data: bytes) -> tuple[np.ndarray, int, tuple[int, int] | None]:
        """The payload -> (the frame, the scale it was decoded at, the picture's (height, width) where reduced)."""
        f = self.frame
        if not data:  # how MQTT clears a retained message: nothing to serve, and no decoder is asked
            raise BadFrame(f"{self.name}: an empty payload")
        if self.cfg.payload == "image" and f.kind == "image" and is_jpeg(np.frombuffer(data[:4], np.uint8)):
            img, scale, full = _decode_jpeg_frame(np.frombuffer(data, np.uint8), self.cfg, f, self.resize,
                                                  self.max_scale, self.stats, self.name)
            if img is None:
                raise BadFrame(f"{self.name}: payload of {len(data)} bytes is not a decodable JPEG")
            return img, scale, full
        if self.cfg.payload == "image":
            img = cv2.imdecode(np.frombuffer(data, np.uint8), imread_flag(f))
            if img is None:
                raise BadFrame(f"{self.name}: payload of {len(data)} bytes is not a decodable image")
            return bgr_to_frame(img, f), 1, None
        if self.cfg.payload == "npy":
            try:
                return read_npy(data), 1, None
            except (ValueError, OSError, EOFError) as exc:
                raise BadFrame(f"{self.name}: payload is not a .npy array: {exc}") from exc
        dtype = np.dtype(f.dtype if f.kind == "sensor" else np.uint8)
        expected = int(np.prod(f.shape)) * dtype.itemsize
        if len(data) != expected:
            raise BadFrame(f"{self.name}: raw payload of {len(data)} bytes, expected {expected} for {f.shape} {dtype}")
        return np.frombuffer(data, dtype).reshape(f.shape).copy(), 1, None

    def read(self, stop: threading.Event) -> Frame | None:
        while not stop.is_set():
            self.stats.beat()
            with self._cond:
                if not self._buf:
                    self._cond.wait(0.2)
                    continue
                data, at, ns = self._buf.popleft()
            try:
                frame, scale, full = self._decode(data)
            except BadFrame:
                self.stats.bad += 1
                raise
            self.stats.frames += 1
            self.stats.last_frame_ns = ns
            return Frame(self.stats.frames, frame, at, ns, self.name, scale, full=full)
        return None

    def close(self) -> None:
        self.client.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
        self.client.loop_stop()


EXIF_TURNS = -1  # a still JPEG: libjpeg turns it by its EXIF orientation, which we do not read before decoding


def _scale_for(cfg: PictureKeys, resize: ResizeSpec | None, height: int, width: int, max_scale: int,
               turns: int) -> tuple[int, int | None]:
    """(The scale to reduce a picture of this size to, the scale it was lowered from or None.) A turned picture
    keeps each reduced pixel on its block only where the scale divides its size: the rounded-up edge (libjpeg's
    partial block, our padding) is at the right and bottom before the turn, elsewhere after it (a review: boxes
    2 pixels off at 1/4). Halved until it divides (phones' 1920 x 1080 and 4K keep 1/8); a forced scale too."""
    wanted = scale = decode_scale(cfg.decode_scale, resize, height, width, limit=max_scale)
    while turns and scale > 1 and (height % scale or width % scale):
        scale //= 2
    return scale, (wanted if scale != wanted else None)


def _log_scale(name: str, scale: int, size: tuple[int, int] | None, lowered: int | None, cfg: PictureKeys,
               **extra: Any) -> None:
    h, w = size if size is not None else (0, 0)
    why = None if lowered is None else (f"a turned picture is reduced only at a scale that divides its size "
                                        f"({w}x{h}: not 1/{lowered})")
    # a scale the config forced and the agent lowered is said as a warning: the user asked for it
    (log.warning if lowered is not None and cfg.decode_scale != "auto" else log.info)(
        "source.decode_scale", source=name, scale=scale, frame=None if size is None else f"{w}x{h}",
        decoded=None if size is None else f"{-(-w // scale)}x{-(-h // scale)}", lowered_from=lowered,
        reason=why, **extra)


def _jpeg_scale(data: np.ndarray, cfg: PictureKeys, resize: ResizeSpec | None, max_scale: int, stats: SourceStats,
                name: str, size: tuple[int, int] | None, turns: int = 0) -> int:
    """The scale to decode this JPEG of `size` (its header's, as displayed; None: unknown) at, recorded in the
    source's stats when it changes. `turns` EXIF_TURNS: it may be turned, the scale must divide its size."""
    scale, lowered = (1, None) if size is None else _scale_for(cfg, resize, *size, max_scale, turns)
    if stats.decoder.get("scale") != scale or stats.decoder.get("path") != "jpeg":
        _log_scale(name, scale, size, lowered, cfg)
        stats.decoder = {**stats.decoder, "path": "jpeg", "scale": scale, "lowered_from": lowered}
    return scale


def _camera_size(size: tuple[int, int] | None, img: np.ndarray, scale: int) -> tuple[int, int] | None:
    """The (height, width) of the picture of header size `size` that a JPEG decoded at 1/scale into `img` (turned
    as its EXIF orientation turned it), for boxes to clip to; None at full scale or where the header does not
    say. The scale divides a still JPEG's size (EXIF_TURNS), so the reduced shape names the turn, but a square's."""
    if size is None or scale == 1:
        return None
    for hw in (size, (size[1], size[0])):
        if reduced_size(*hw, scale) == img.shape[:2]:
            return hw
    return None


def _decode_jpeg_frame(data: np.ndarray, cfg: PictureKeys, frame: FrameSpec, resize: ResizeSpec | None,
                       max_scale: int, stats: SourceStats,
                       name: str) -> tuple[np.ndarray | None, int, tuple[int, int] | None]:
    """One JPEG -> (the frame at the scale the model allows, in the bundle's colours, scale, the picture's
    (height, width) where reduced); (None, 1, None) when it does not decode."""
    size = jpeg_size(data)
    scale = _jpeg_scale(data, cfg, resize, max_scale, stats, name, size, EXIF_TURNS)
    img = decode_jpeg(data, frame.color, scale)
    return (None, 1, None) if img is None else (img, scale, _camera_size(size, img, scale))


SourceFactory = Callable[..., FrameSource]  # (its type's config, the bundle's frame, resize, max_scale) -> source


def _sensor_source(cfg: SourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None,
                   max_scale: int = 8) -> FrameSource:
    from agent.serving.sensors import SensorSource  # its own module (streams, time); it imports this one

    return SensorSource(cfg, frame, resize, max_scale)


def _mqtt_source(cfg: MqttSourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None,
                 max_scale: int = 8) -> FrameSource:
    """payload: samples is a sensor stream (windows cut in stream time); other payloads are whole frames."""
    if cfg.payload == "samples":
        return _sensor_source(cfg, frame, resize, max_scale)
    return MqttFrameSource(cfg, frame, resize, max_scale)


# The opener of each source type, by its `type` (the config classes are registered in agent.source_types)
OPENERS: dict[str, SourceFactory] = {
    "folder": FolderSource,
    "video": OpenCVSource,
    "camera": OpenCVSource,
    "stream": OpenCVSource,
    "udp": _sensor_source,
    "file": _sensor_source,
    "stdin": _sensor_source,
    "mqtt": _mqtt_source,
}


def register_source(cls: type[SourceConfig], opener: SourceFactory) -> None:
    """A new source type, in one call from its own module: its config class (parsed, checked, in the schema and
    the docs) and the opener the pipeline makes its source with."""
    register_type(cls)
    OPENERS[cls.TYPE] = opener


def unregister_source(name: str) -> None:
    """Remove a source type and its opener (a test's throwaway type, after the test)."""
    unregister_type(name)
    OPENERS.pop(name, None)


def open_source(cfg: SourceConfig, frame: FrameSpec, resize: ResizeSpec | None = None,
                max_scale: int = 8) -> FrameSource:
    """The source `cfg` names. `resize`, the bundle's preprocess resize, lets JPEG sources decode at reduced
    scale (decode_scale: auto), at most `max_scale` (the largest the self-test proved); without `resize`
    they decode at full size unless decode_scale names a scale."""
    try:
        factory = OPENERS[cfg.type]
    except KeyError:
        raise ConfigError(f"source.type: unknown source {cfg.type!r} (known: {sorted(OPENERS)})") from None
    if frame.kind == "image" and cfg.delivers() == "sensor":
        raise ConfigError(f"source.type: {cfg.type} delivers sensor windows, but the bundle takes image frames")
    return factory(cfg, frame, resize, max_scale)


def uses_pyav(cfg: SourceConfig) -> bool:
    """Whether this source will decode through PyAV (as `OpenCVSource._use_av` decides, before the bundle is known):
    files and streams without hardware decoding; a V4L2 camera index stays with OpenCV."""
    if not isinstance(cfg, FfmpegKeys) or cfg.hw_decode != "none":
        return False
    return not (isinstance(cfg, CameraSourceConfig) and cfg.is_v4l2_index())


def warm_decoder(cfgs: Sequence[SourceConfig]) -> None:
    """Import PyAV now when a configured source will decode through it: run on a thread while the boot proof
    runs in its child, so the first frame does not wait for the import (78 ms of CPU, 215 ms under load
    here). Folder, sensor and MQTT agents still never import it."""
    if any(uses_pyav(c) for c in cfgs) and ffmpeg_decode.available():
        try:
            ffmpeg_decode._av()
        except ImportError:
            pass  # the source says so when it opens


def retarget_decode(source: FrameSource, resize: ResizeSpec | None, max_scale: int) -> None:
    """A new bundle's resize and proven decode scale, taken by a running source from its next frame on."""
    if isinstance(source, Retargetable):
        source.resize, source.max_scale = resize, max_scale


def video_sources(source: FrameSource) -> list[OpenCVSource]:
    """The sources behind `source` (itself, or each of many) that decode video: the planner sizes their decoders."""
    return [s for s in inner_sources(source) if isinstance(s, OpenCVSource)]


def is_lossless(cfg: SourceConfig, source: FrameSource) -> bool:
    return (not source.live) if cfg.lossless is None else cfg.lossless
