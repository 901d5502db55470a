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
from typing import Any, Callable, Sequence

import cv2
import numpy as np

from agent.config import SourceConfig
from agent.source_types import (CameraSourceConfig, FfmpegKeys, FolderSourceConfig, MqttSourceConfig, StreamSourceConfig, VideoSourceConfig)
from agent.source_types.registry import register as register_type
from agent.source_types.registry import unregister as unregister_type
from agent.errors import BadFrame, ConfigError, UndecodableFrame
from agent.logsetup import get_logger
from agent.serving import ffmpeg_decode
from agent.serving.decoding import decode_jpeg, is_jpeg, jpeg_size
from agent.serving.capabilities import Retargetable, inner_sources
from agent.serving.sizing import DecoderLoad
from agent.serving.source_checks import probe_video
from agent.vocabulary.jpeg import MJPEG_FOURCCS
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.vocabulary.preprocess import IMAGE_SUFFIXES, bgr_to_frame, read_image_file

from agent.serving.frames import (  # noqa: F401 (what callers import from here)
    CAPTURE_THREAD, Frame, FrameSource, Pacer, SourceStats, now_pair, reads_in_flight,
)
from agent.serving.mqtt_frames import MqttFrameSource
from agent.serving.picture_scale import decode_jpeg_frame, jpeg_scale, log_scale, scale_for

log = get_logger("source")

JPEG_SUFFIXES = (".jpg", ".jpeg")
HW_DECODE = {"none": cv2.VIDEO_ACCELERATION_NONE, "any": cv2.VIDEO_ACCELERATION_ANY,
             "vaapi": cv2.VIDEO_ACCELERATION_VAAPI, "d3d11": cv2.VIDEO_ACCELERATION_D3D11,
             "mfx": cv2.VIDEO_ACCELERATION_MFX, "drm": cv2.VIDEO_ACCELERATION_DRM}


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
        self.pacer = Pacer(cfg.max_fps)

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
            data, scale, full = decode_jpeg_frame(np.fromfile(path, np.uint8), self.cfg, self.frame, self.resize,
                                                   self.max_scale, self.stats, self.name)
        else:
            data = read_image_file(str(path), self.frame)
        if data is None:
            self.stats.bad += 1
            raise BadFrame(f"{path}: cannot decode image")
        at, ns = now_pair()
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
        self.pacer = Pacer(cfg.max_fps if isinstance(cfg, VideoSourceConfig) else 0.0)
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
            at, ns = now_pair()
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
                scale = jpeg_scale(img, self.cfg, self.resize, self.max_scale, self.stats, self.name, size, turns)
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
        scale, lowered = scale_for(self.cfg, self.resize, h, w, self.max_scale, self.turns)
        if self.stats.decoder.get("scale") != scale:
            log_scale(self.name, scale, (h, w), lowered, self.cfg, codec=self.stats.decoder.get("codec"))
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
