"""The broker connection: availability with a last will, retained health and self-test, commands with
replies, and the pump that moves the outbox to the broker.

paho-mqtt 2.x, callback API v2, MQTT 5 by default. A broker that is down at boot never stops the agent:
the client reconnects with backoff in its own thread while the agent self-tests and serves.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.config import MqttConfig, PayloadError, parse_json_object
from agent.errors import ConfigError
from agent.fsio import bump_counter, read_counter
from agent.logsetup import get_logger
from agent.link.outbox import Message, Outbox
from agent.link.superseded import drop_queued
from agent.link.topics import Topics, default_prefix

log = get_logger("mqtt")


@dataclass(frozen=True)
class Command:
    name: str
    payload: dict[str, Any]
    response_topic: str | None
    correlation: bytes | None


# Called on paho's network thread and must return at once: the answer, or None when the handler replies later
# itself (the controller queues the command; agent.service.commands.CommandInlet).
CommandHandler = Callable[[Command], dict[str, Any] | None]


def resolve_password(cfg: MqttConfig) -> str | None:
    """From the config, a file, or an environment variable; the value itself is never logged."""
    if cfg.password_file is not None:
        try:
            return cfg.password_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"key mqtt.password_file: cannot read {cfg.password_file}: {exc.strerror}") from exc
    if cfg.password_env is not None:
        value = os.environ.get(cfg.password_env)
        if value is None:
            raise ConfigError(f"key mqtt.password_env: environment variable {cfg.password_env} is not set")
        return value
    return cfg.password


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(doc: Any) -> bytes:
    """RFC 8259 JSON: a non-finite float (which Python would write as NaN or Infinity) becomes null."""
    try:
        return json.dumps(doc, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(doc), allow_nan=False).encode()


def _availability(state: str, session: int, instance: str = "") -> bytes:
    doc: dict[str, Any] = {"state": state, "session": session, "ts": round(time.time(), 3)}
    if instance:
        doc["instance"] = instance  # this agent process: a second live agent under one device_id differs here
    return json.dumps(doc).encode()


TWIN_LOG_EVERY_S = 30.0  # a twin's takeovers come every few seconds: said at once, then at most this often


class MqttLink:
    def __init__(self, cfg: MqttConfig, device_id: str, state_dir: Path, outbox: Outbox,
                 on_command: CommandHandler, retained: Callable[[], dict[str, bytes]],
                 on_bundle: Callable[[str, bytes], None] | None = None, instance: str = ""):
        self.cfg = cfg
        self.device_id, self.instance = device_id, instance
        # another live agent under this device_id (a cloned card, a copied config): what was seen of it
        self.twin: dict[str, Any] | None = None
        self._retained_seen: dict[str, float] = {}  # other instance -> its retained availability's ts first seen
        self._twin_logged = 0.0
        self.topics = Topics(cfg.prefix or default_prefix(device_id))
        self.outbox = outbox
        self.on_command = on_command
        self.retained = retained  # topic -> payload to (re)publish on every connect
        self.on_bundle = on_bundle  # the update transfer protocol (bundle/#), when updates are enabled
        # incremented on every connect and persisted, so a stale last will never hides the live session
        self._session_file = state_dir / "mqtt-session"
        self.session = read_counter(self._session_file)
        self.connected = threading.Event()
        # the connect's republish and every other retained publish, one at a time: a document the controller
        # publishes while the connect republishes is sent after the connect's (never dropped as "not connected")
        self._retained_lock = threading.Lock()
        self._stop = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, name="mqtt-pump", daemon=True)
        v5 = cfg.protocol == "5"
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=cfg.client_id or f"edge-agent-{device_id}",
                                  protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
                                  clean_session=None if v5 else cfg.clean_start)
        self.v5 = v5
        # A bug in one of our callbacks must cost that message, never paho's network thread.
        self.client.suppress_exceptions = True
        # paho's own lines become structured events: a plain line would break the JSON log stream
        self.client.on_log = self._on_paho_log
        self.client.on_connect_fail = self._on_connect_fail
        self.client.max_inflight_messages_set(cfg.max_inflight)
        self.client.max_queued_messages_set(0)
        # paho's backoff has no jitter: each device draws its own first delay, so a fleet does not retry in lock-step
        self.client.reconnect_delay_set(cfg.reconnect_min_s * random.uniform(0.5, 1.5), cfg.reconnect_max_s)  # type: ignore[arg-type]
        if cfg.username:
            self.client.username_pw_set(cfg.username, resolve_password(cfg))
        if cfg.tls is not None:
            t = cfg.tls
            self.client.tls_set(ca_certs=str(t.ca_file) if t.ca_file else None,
                                certfile=str(t.cert_file) if t.cert_file else None,
                                keyfile=str(t.key_file) if t.key_file else None,
                                cert_reqs=ssl.CERT_NONE if t.insecure else ssl.CERT_REQUIRED)
            self.client.tls_insecure_set(t.insecure)
            if t.insecure:
                log.warning("mqtt.tls_insecure", detail="certificate verification is OFF (tls.insecure: true)")
        self._set_will()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "MqttLink":
        props = None
        if self.v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.cfg.session_expiry_s
            props.MaximumPacketSize = self.cfg.max_packet_bytes
        clean = self.cfg.clean_start if self.v5 else paho.MQTT_CLEAN_START_FIRST_ONLY
        self.client.connect_async(self.cfg.host, self.cfg.port, self.cfg.keepalive, clean_start=clean, properties=props)
        self.client.loop_start()
        self._pump_thread.start()
        log.info("mqtt.starting", host=self.cfg.host, port=self.cfg.port, prefix=self.topics.prefix,
                 protocol=self.cfg.protocol, tls=self.cfg.tls is not None)
        return self

    def stop(self, drain_s: float = 5.0) -> None:
        """Graceful: give the outbox a moment to drain, say `stopped`, disconnect, keep the rest on disk."""
        deadline = time.monotonic() + drain_s
        while self.connected.is_set() and self.outbox.depth and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._pump_thread.join(timeout=5)
        if self.connected.is_set():
            info = self.client.publish(self.topics.availability, _availability("stopped", self.session, self.instance),
                                       qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=3)
            except (RuntimeError, ValueError):
                pass
            self.client.disconnect()
        self.client.loop_stop()
        self.outbox.close()

    # -- publishing ------------------------------------------------------------------------------------
    def publish_retained(self, topic: str, payload: bytes) -> None:
        """Latest-state topics bypass the outbox: only the newest value matters, and it is sent on connect."""
        with self._retained_lock:
            if self.connected.is_set():
                self.client.publish(topic, payload, qos=1, retain=True)

    def publish_now(self, topic: str, payload: bytes) -> bool:
        """A reply's payload (a snapshot's JPEG): QoS 1, not retained, not through the outbox (nothing on disk; an
        answer nobody receives while the link is down is not worth replaying). False when the link is down."""
        if not self.connected.is_set():
            return False
        return bool(self.client.publish(topic, payload, qos=1).rc == paho.MQTT_ERR_SUCCESS)

    def _send(self, msg: Message) -> int | None:
        if not self.connected.is_set():
            return None
        info = self.client.publish(msg.topic, msg.payload, qos=msg.qos)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            return None
        return info.mid

    def _pump(self) -> None:
        was_connected = False
        failing = False
        while not self._stop.is_set():
            try:
                now_connected = self.connected.is_set()
                if now_connected != was_connected:
                    (self.outbox.on_connected if now_connected else self.outbox.on_disconnected)()
                    was_connected = now_connected
                self.outbox.pump(self._send, self.cfg.max_inflight)
                failing = False
            except Exception:  # never let a storage hiccup kill delivery; it is logged (once) and retried
                if not failing:
                    log.exception("outbox.pump_failed")
                failing = True
                time.sleep(0.5)
            self.outbox.wait(0.05)

    # -- callbacks (paho's network thread) -------------------------------------------------------------
    def _set_will(self) -> None:
        self.client.will_set(self.topics.availability, _availability("offline", self.session + 1, self.instance),
                             qos=1, retain=True)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.warning("mqtt.connect_refused", reason=str(reason))
            return
        try:
            self._session_up(client)
        except Exception:
            # never half-connected: subscribed to nothing, the agent would be connected but deaf and mute for
            # as long as the broker stays up. Drop the connection; paho reconnects with backoff and we retry.
            log.exception("mqtt.connect_setup_failed", detail="dropping the connection to retry")
            self._drop_connection(client)

    def _session_up(self, client: paho.Client) -> None:
        try:
            self.session = bump_counter(self._session_file)
        except OSError as exc:  # a full disk: the session number still moves on, in memory
            self.session += 1
            log.error("mqtt.session_not_recorded", file=str(self._session_file), error=str(exc))
        # subscriptions first: commands and transfers are heard even if a publish below fails
        topics = [self.topics.commands] + ([self.topics.bundle_all] if self.on_bundle is not None else []) + (
            [f"{self.cfg.homeassistant_prefix}/status"] if self.cfg.homeassistant else []) + (
            [self.topics.availability] if self.instance else [])  # a twin's availability (or last will)
        rc, _ = client.subscribe([(t, 1) for t in topics])
        if rc != paho.MQTT_ERR_SUCCESS:
            raise ConnectionError(f"subscribe to {topics} failed: {paho.error_string(rc)}")
        with self._retained_lock:
            self._republish(client)
            self.connected.set()
        log.info("mqtt.connected", session=self.session, host=self.cfg.host, port=self.cfg.port)

    def _republish(self, client: paho.Client) -> None:
        """Availability and the current retained documents, replacing what paho still holds of older ones
        (agent/link/superseded.py: sent after these, they would be the ones the broker keeps)."""
        online = _availability("online", self.session, self.instance)
        try:
            docs = {self.topics.availability: online, **self.retained()}
        except Exception:  # never let it kill paho's network thread: the next health publish repairs it
            log.exception("mqtt.retained_publish_failed")
            docs = {self.topics.availability: online}
        dropped = drop_queued(client, docs)
        if dropped:
            log.info("mqtt.superseded_dropped", count=dropped, detail="older retained documents not sent again")
        for topic, payload in docs.items():
            client.publish(topic, payload, qos=1, retain=True)

    @staticmethod
    def _drop_connection(client: paho.Client) -> None:
        """Close the socket under paho without a DISCONNECT: paho sees a lost connection and reconnects
        (client.disconnect() would end its loop for good)."""
        shutdown = getattr(client.socket(), "shutdown", None)  # a websocket wrapper has none
        if shutdown is not None:
            try:
                shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def _on_paho_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        # paho logs "Client is not connected" at ERR between retries and after our own disconnect: not an error
        if level == paho.MQTT_LOG_ERR and not buf.startswith("Client is not connected"):
            log.error("mqtt.client_error", detail=buf)
        elif level == paho.MQTT_LOG_WARNING:
            log.warning("mqtt.client_warning", detail=buf)

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        log.warning("mqtt.connect_failed", host=self.cfg.host, port=self.cfg.port, tls=self.cfg.tls is not None,
                    detail="broker unreachable, refused or TLS failed; retrying with backoff")

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        was = self.connected.is_set()
        self.connected.clear()
        self._set_will()  # the next connection's will carries the next session number
        if was:  # our own stop is a clean, expected disconnect
            (log.info if self._stop.is_set() else log.warning)("mqtt.disconnected", reason=str(reason))
        if "taken over" in str(reason).lower():  # MQTT 5: another client connected under our client id
            self._twin_seen(None, "session taken over: another client connected with this client id")

    def _twin_seen(self, other: str | None, how: str) -> None:
        now = time.time()
        prev = self.twin or {}
        self.twin = {"instance": other or prev.get("instance"), "how": how, "count": int(prev.get("count", 0)) + 1,
                     "first_ts": prev.get("first_ts", round(now, 3)), "last_ts": round(now, 3)}
        if now - self._twin_logged >= TWIN_LOG_EVERY_S:
            self._twin_logged = now
            log.error("mqtt.twin_detected", device_id=self.device_id, ours=self.instance, twin=self.twin,
                      reason=f"a second live agent uses device_id {self.device_id!r} (a cloned card, a copied "
                             "config): the broker knocks each off in turn; give each device its own device_id")

    def _on_availability(self, msg: paho.MQTTMessage) -> None:
        """Our own availability topic: another instance that is alive is a second agent under our device_id.
        With one client id the two are never connected together (each connect knocks the other off), so what
        each sees is the other's retained `online` or last will at its subscribe. Alive means live: a message
        delivered live, or a retained one that changed since we first saw it (republished: its writer runs).
        The retained message of this device's previous process (a restart) never changes; its timestamp is
        not compared with our clock, which may be behind the previous boot's (no RTC, before NTP)."""
        try:
            doc = json.loads(msg.payload)
            other = str(doc.get("instance") or "")
            written = float(doc.get("ts") or 0)
        except (ValueError, AttributeError, TypeError):
            return
        if not other or other == self.instance:
            return
        first = self._retained_seen.get(other)
        if msg.retain and len(self._retained_seen) < 64:
            self._retained_seen.setdefault(other, written)
        if not msg.retain or (first is not None and written != first):
            self._twin_seen(other, f"its availability {str(doc.get('state'))[:20]!r} on our topic")

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        self.outbox.ack(mid)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic == self.topics.availability:
            self._on_availability(msg)
            return
        if msg.topic == f"{self.cfg.homeassistant_prefix}/status":
            if msg.payload == b"online":
                with self._retained_lock:
                    for topic, payload in self.retained().items():
                        client.publish(topic, payload, qos=1, retain=True)
            return
        if self.on_bundle is not None and msg.topic.startswith(self.topics.prefix + "bundle/"):
            try:
                self.on_bundle(msg.topic, bytes(msg.payload))
            except Exception:  # a bad transfer message must not take the network thread down
                log.exception("bundle.message_failed", topic=msg.topic)
            return
        name = self.topics.command_name(msg.topic)
        if name is None:
            return
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        if isinstance(correlation, (bytes, bytearray)) and len(correlation) > 256:
            correlation = None
        name = name[:64]
        if response_topic is not None and not self.reply_allowed(response_topic):
            # never publish where the caller points: another device's cmd/ or our own predictions
            self.reply(Command(name, {}, None, correlation),
                       {"ok": False, "error": f"response topic {response_topic[:200]!r} is outside this device's "
                                              f"reply namespace {self.topics.prefix}reply/# (allow more with "
                                              "mqtt.reply_topics); the command was not run"})
            return
        try:
            body = parse_json_object(bytes(msg.payload), self.cfg.max_payload_bytes, self.cfg.max_json_depth)
        except PayloadError as exc:
            self.reply(Command(name, {}, response_topic, correlation),
                       {"ok": False, "error": f"malformed payload: {exc}"})
            return
        cmd = Command(name, body, response_topic, correlation)
        # The handler returns at once (the controller queues the command and replies itself when it has the
        # answer; a full queue is answered busy here): paho's network thread is never held, no thread per command.
        try:
            result = self.on_command(cmd)
        except Exception as exc:  # a failing command is an error reply, never a dead network thread
            log.exception("command.failed", command=cmd.name)
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if result is not None:
            self.reply(cmd, result)

    def reply_allowed(self, topic: str) -> bool:
        if not topic or len(topic) > 512 or any(c in topic for c in "+#\0"):
            return False
        own = self.topics.prefix + "reply/"
        if topic.startswith(own) and len(topic) > len(own):
            return True
        return any(paho.topic_matches_sub(f, topic) for f in self.cfg.reply_topics)

    def reply(self, cmd: Command, result: dict[str, Any]) -> None:
        cid = cmd.payload.get("id")
        body = {"command": cmd.name, **({"id": cid} if isinstance(cid, (str, int, float)) else {}), **result}
        props = None
        if self.v5 and cmd.correlation is not None:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = cmd.correlation
        topic = cmd.response_topic or self.topics.reply(cmd.name)
        self.client.publish(topic, strict_json(body), qos=1, properties=props)
        log.info("command.replied", command=cmd.name, ok=result.get("ok"), topic=topic)
