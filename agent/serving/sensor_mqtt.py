"""The MQTT reader of a sensor source (`payload: samples`): each payload of one topic is a chunk of one stream's
samples, in the order published (QoS 1), numbered with `framing: seq32` so a payload the broker dropped is a
hole counted like a UDP datagram's (agent/serving/sensor_losses.py). Mixed into SensorSource."""

from __future__ import annotations

import fcntl
import struct
import termios
import threading
import time
from typing import Any

from agent.errors import ConfigError
from agent.logsetup import get_logger
from agent.serving.sensor_losses import SEQ, SEQ_BYTES, LossCounting
from agent.serving.sources import SourceStats
from agent.source_types import MqttSourceConfig

log = get_logger("source")


def topic_filter_problem(cfg: MqttSourceConfig, key: str = "source") -> str | None:
    """A topic filter where one stream's topic is needed (refused at boot and by `config check` alike)."""
    if cfg.payload != "samples" or not cfg.topic or ("+" not in cfg.topic and "#" not in cfg.topic):
        return None
    return (f"{key}.topic: {cfg.topic!r} with payload: samples is one stream: name one topic, not a filter "
            "(samples of two publishers would mix in one window)")


class MqttSamples(LossCounting):
    """paho's callbacks, run on paho's network thread: payloads into the topic's one stream."""

    name: str
    stats: SourceStats
    client: Any
    topic: str | None
    _mqtt_idle: float | None
    _closing: threading.Event

    def _mqtt_open(self, cfg: MqttSourceConfig) -> str:
        """An MQTT topic whose payloads are chunks of one stream's samples, in the order published."""
        import paho.mqtt.client as paho

        if not cfg.topic:
            raise ConfigError("source.topic: an mqtt source needs the topic samples arrive on")
        why = topic_filter_problem(cfg)
        if why is not None:
            raise ConfigError(why)
        self.topic = cfg.topic
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2)
        self.client.on_connect = self._mqtt_connected
        self.client.on_disconnect = self._mqtt_disconnected
        self.client.on_message = self._mqtt_message
        self.client.reconnect_delay_set(int(max(cfg.reconnect_initial_s, 1)), int(cfg.reconnect_max_s))
        return cfg.name or f"mqtt:{cfg.host}:{cfg.port or 1883}/{cfg.topic}"

    def _mqtt_connected(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if not rc.is_failure:
            # QoS 1: the broker hands the topic's messages over in order, resending what TCP did not confirm
            client.subscribe(self.topic, qos=1)
            self.stats.state = "open"

    def _mqtt_disconnected(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        """What was published while the agent was not connected never arrives: a hole in the stream."""
        if self._closing.is_set():
            return
        with self._cond:
            self.stats.losses += 1
            self.stats.state = "lost"
            for st in self.streams.values():
                if st.received:
                    # one hole: the jump in the numbers after it counts its samples, not another restart
                    self._hole(st, 0, "the MQTT connection was lost: samples published meanwhile were not delivered")
        log.warning("source.lost", source=self.name, reason="MQTT connection lost")

    def _mqtt_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.time()
        data = bytes(msg.payload)
        seq = None
        if self.sequenced and len(data) >= SEQ_BYTES:
            (seq,) = SEQ.unpack_from(data)
            data = data[SEQ_BYTES:]
        with self._cond:
            if (not data and seq is None) or len(data) % self.sample_bytes or (self.sequenced and seq is None):
                self.stats.bad += 1
                head = f"a {SEQ_BYTES}-byte sequence number and " if self.sequenced else ""
                self._bad.append(f"{self.name}: payload of {len(msg.payload)} bytes is not {head}whole samples of "
                                 f"{self.sample_bytes} bytes")
            else:
                s = self.streams[None]
                # late or duplicated: counted, dropped; a numbered payload of no samples takes its number only
                for got, _at in (self._sequence(s, seq, data, now) if seq is not None else [(data, now)]):
                    if got:
                        # silence counts from when paho's thread last found the connection empty (None: this
                        # payload was already waiting behind the last one -- the agent's backlog, never a gap)
                        self._take(s, got, now, self._mqtt_idle)
                self._shed(s)
            self._mqtt_idle = None if self._mqtt_waiting(client) else time.time()
            self._cond.notify_all()

    @staticmethod
    def _mqtt_waiting(client: Any) -> bool:
        """Bytes of the next message already in the connection's receive queue (paho reads one packet at a
        time, so what the kernel holds is what is waiting)."""
        sock = client.socket()
        if sock is None:
            return False
        if hasattr(sock, "pending") and sock.pending():  # TLS: decrypted bytes not read yet
            return True
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] > 0
        except (OSError, ValueError):
            return False
