"""MQTT picture frames: each payload an image (JPEG, PNG...), an .npy array or raw bytes in the bundle's
frame shape, latest-frame-wins (a stateful bundle takes samples: agent/serving/sensors.py)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import cv2
import numpy as np

from agent.source_types import (MqttSourceConfig)
from agent.errors import BadFrame, ConfigError
from agent.logsetup import get_logger
from agent.npio import read_npy
from agent.serving.decoding import is_jpeg
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.vocabulary.preprocess import bgr_to_frame, imread_flag

from agent.serving.frames import Frame, SourceStats, now_pair
from agent.serving.picture_scale import decode_jpeg_frame

log = get_logger("source")


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
        at, ns = now_pair()
        with self._cond:
            self._buf.append((msg.payload, at, ns))  # type: ignore[attr-defined]
            self._cond.notify()

    def _decode(self, data: bytes) -> tuple[np.ndarray, int, tuple[int, int] | None]:
        """The payload -> (the frame, the scale it was decoded at, the picture's (height, width) where reduced)."""
        f = self.frame
        if not data:  # how MQTT clears a retained message: nothing to serve, and no decoder is asked
            raise BadFrame(f"{self.name}: an empty payload")
        if self.cfg.payload == "image" and f.kind == "image" and is_jpeg(np.frombuffer(data[:4], np.uint8)):
            img, scale, full = decode_jpeg_frame(np.frombuffer(data, np.uint8), self.cfg, f, self.resize,
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
