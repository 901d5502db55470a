"""Where a rollout lives: retained, versioned documents on the broker, so any operator machine with the
credentials can read it and resume it after the operator that ran it died. No fleet server.

  fleet/rollout/<id>/plan              the plan (written once)
  fleet/rollout/<id>/state             {rev, status, phase, owner, heartbeat, decisions[...]}; rev + 1 per write
  fleet/rollout/<id>/device/<device>   {state: started|committed|failed, phase, started, kind, reason, rollback}
  fleet/rollout/<id>/control           the newest human request: pause | resume | abort | approve
A device record is written (and acknowledged by the broker) BEFORE its update command is sent: a
device with a record is never commanded again, so an operator killed at any point updates no device twice.
"""

from __future__ import annotations

import json
import queue
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho

from agent.link.topics import ROOT
from agent.logsetup import get_logger

log = get_logger("fleet")

FLEET_ROOT = "fleet"
STATE_SCHEMA = 1
MAX_DECISIONS = 500  # the state document stays well under brokers' retained-message limits (EMQX: 1 MB)


@dataclass(frozen=True)
class RolloutTopics:
    id: str
    root: str = FLEET_ROOT

    @property
    def base(self) -> str:
        return f"{self.root}/rollout/{self.id}/"

    @property
    def plan(self) -> str:
        return self.base + "plan"

    @property
    def state(self) -> str:
        return self.base + "state"

    @property
    def control(self) -> str:
        return self.base + "control"

    @property
    def rejections(self) -> str:
        """{device: provider} of every device whose self-test rejected the bundle: what a later `plan`
        for the same archive reads, instead of every record of every rollout."""
        return self.base + "rejections"

    def device(self, device: str) -> str:
        return self.base + f"device/{device}"

    @property
    def all(self) -> str:
        return self.base + "#"


@dataclass(frozen=True)
class SyncPolicy:
    """When a read of the retained fleet is complete, without assuming any delivery order.

    MQTT promises no order between a subscription's retained deliveries and anything else (a clustered
    broker's retainer delivers them from another process, rate-limited), so no marker can say "that was
    all". The rule: complete once no retained document arrived for a quiet period, the longer of
    `quiet_s` and `gap_factor` times the longest gap seen between two of them (a trickle sets its own
    pace). The bound grows with what arrives: `base_s` plus `per_doc_s` for each retained document, so a
    big fleet is never cut off by a fixed deadline, and a broker that never stops delivering is."""

    quiet_s: float = 2.0
    gap_factor: float = 4.0
    max_quiet_s: float = 30.0
    base_s: float = 30.0
    per_doc_s: float = 0.05

    def bound(self, docs: int) -> float:
        return self.base_s + self.per_doc_s * docs

    def quiet(self, longest_gap: float) -> float:
        return min(self.max_quiet_s, max(self.quiet_s, self.gap_factor * longest_gap))


@dataclass(frozen=True)
class Connection:
    host: str = "127.0.0.1"
    port: int = 1883
    tls_ca: str | None = None
    username: str | None = None
    password: str | None = None
    device_root: str = ROOT
    sync: SyncPolicy = SyncPolicy()
    protocol: str = "5"  # "5" or "3.1.1" (--mqtt-protocol): for brokers without MQTT 5, e.g. aedes


MQTT_PROTOCOLS = {"5": paho.MQTTProtocolVersion.MQTTv5, "3.1.1": paho.MQTTProtocolVersion.MQTTv311}


def mqtt_protocol(name: str) -> paho.MQTTProtocolVersion:
    """paho's constant for a --mqtt-protocol value, or a clear error naming the option."""
    try:
        return MQTT_PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"--mqtt-protocol {name!r}: expected one of {sorted(MQTT_PROTOCOLS)}") from None


def parse_broker(spec: str) -> tuple[str, int]:
    host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", "1883")
    return host or "127.0.0.1", int(port)


class FleetClient:
    """One operator connection: every message goes to a queue the operator's loop drains; retained
    documents are published QoS 1 and (when asked) waited for until the broker acknowledged them.

    It survives its broker: paho's thread reconnects (1..5 s backoff) under the same client id, with a
    session the broker keeps for `session_s` (so a broker that kept state keeps the subscriptions and
    what was queued for it), and resends every unacknowledged QoS 1 publish. A publish made while the
    link is down waits for that resend's PUBACK instead of failing: nothing the operator decides is
    lost to a broker restart, and a slow acknowledgement is waited for, with a warning every 30 s."""

    def __init__(self, conn: Connection, client_id: str | None = None, session_s: int = 0):
        self.conn = conn
        self.session_s = session_s
        self.connects = 0  # acknowledged connections: a new one after the first is a reconnect
        self.inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self.connected = threading.Event()
        self.subscribed = threading.Event()  # the broker acknowledged this connection's subscriptions
        self._subs: list[str] = []
        self._sub_mids: set[int] = set()
        self.v5 = conn.protocol == "5"
        # MQTT 3.1.1 has no session expiry: a clean session, and every reconnect subscribes again and reads
        # the retained documents anew (what a session kept would add: live replies sent while it was away)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id or f"fleet-{uuid.uuid4().hex[:8]}",
                                  protocol=mqtt_protocol(conn.protocol),
                                  clean_session=None if self.v5 else True)
        if conn.tls_ca:
            self.client.tls_set(ca_certs=conn.tls_ca, cert_reqs=ssl.CERT_REQUIRED)
        if conn.username:
            self.client.username_pw_set(conn.username, conn.password)
        self.client.max_inflight_messages_set(200)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload), bool(m.retain)))
        self.client.on_disconnect = lambda *a: self.connected.clear()
        self.client.on_subscribe = self._on_subscribe
        self.client.reconnect_delay_set(1, 5)

    def start(self, topics: list[str], timeout: float = 15.0) -> FleetClient:
        self._subs = topics
        props = None
        if self.session_s and self.v5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_s
        if self.v5:
            self.client.connect(self.conn.host, self.conn.port, 30, clean_start=paho.MQTT_CLEAN_START_FIRST_ONLY,
                                properties=props)
        else:
            self.client.connect(self.conn.host, self.conn.port, 30)
        self.client.loop_start()
        if not self.connected.wait(timeout):
            raise TimeoutError(f"cannot reach the broker at {self.conn.host}:{self.conn.port}")
        return self

    def _on_connect(self, c: paho.Client, u: Any, f: Any, reason: Any, p: Any) -> None:
        if reason.is_failure:
            return
        self.connects += 1
        if self._subs:  # again on every connect: a broker that lost its state lost the subscriptions too
            # One SUBSCRIBE per topic: aedes 1.2 on aedes-persistence-redis 11.2 never acknowledges a
            # persistent session's SUBSCRIBE that names two or more topics (docs/fleet.md, the brokers)
            self._sub_mids = {mid for t in self._subs if (mid := c.subscribe(t, 1)[1]) is not None}
        else:
            self.subscribed.set()
        self.connected.set()

    def _on_subscribe(self, c: paho.Client, u: Any, mid: int, reasons: Any, p: Any) -> None:
        self._sub_mids.discard(mid)
        if not self._sub_mids:
            self.subscribed.set()

    def sync(self) -> list[tuple[str, bytes, bool]]:
        """Everything retained under the subscriptions (and whatever live message came meanwhile), complete
        by the connection's SyncPolicy: a quiet period after the last retained delivery, within a bound
        that grows with the documents read."""
        p = self.conn.sync
        if not self.subscribed.wait(p.base_s):
            raise TimeoutError(f"the broker at {self.conn.host}:{self.conn.port} did not acknowledge the "
                               f"subscriptions within {p.base_s:g} s (--sync-timeout)")
        got: list[tuple[str, bytes, bool]] = []
        t0 = last = time.monotonic()
        docs, gap = 0, 0.0
        while True:
            now = time.monotonic()
            if now - last >= p.quiet(gap):
                return got
            if now - t0 > p.bound(docs):
                raise TimeoutError(
                    f"the broker was still delivering retained documents after {now - t0:.0f} s ({docs} so far, the "
                    f"longest gap {gap:.2f} s); the bound is --sync-timeout {p.base_s:g} s + {p.per_doc_s:g} s per "
                    f"document = {p.bound(docs):.0f} s: raise --sync-timeout if the fleet is that big or the broker "
                    "that slow")
            try:
                item = self.inbox.get(timeout=min(0.2, max(0.01, p.quiet(gap) - (now - last))))
            except queue.Empty:
                continue
            got.append(item)
            if item[2]:  # a retained delivery: live messages neither extend nor end the read
                now = time.monotonic()
                gap, last, docs = max(gap, now - last), now, docs + 1

    def publish(self, topic: str, doc: Any, retain: bool = True, wait: bool = True) -> None:
        payload = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if info.rc == paho.MQTT_ERR_QUEUE_SIZE:
            raise RuntimeError(f"paho's outgoing queue is full; {topic} was not queued")
        if not wait:
            return
        # Not info.wait_for_publish: it raises at once when the link was down at publish time (rc NO_CONN),
        # although paho keeps the message and resends it on reconnect. Waited for here, however long.
        t0 = time.monotonic()
        warned = t0
        with info._condition:
            while not info._published:
                info._condition.wait(0.5)
                if time.monotonic() - warned >= 30.0:
                    warned = time.monotonic()
                    log.warning("fleet.publish_waiting", topic=topic, waited_s=round(warned - t0),
                                connected=self.connected.is_set())

    def stop(self) -> None:
        props = None
        if self.session_s and self.v5:  # a clean stop ends the session: the broker queues nothing more for it
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = 0
        self.client.disconnect(properties=props)
        self.client.loop_stop()


def control_request(rollout_id: str, published: float, action: str, by: str, ts: float | None = None,
                    **detail: Any) -> dict[str, Any]:
    """A human request to one rollout, bound to it by its id and the time its plan was published: a
    retained request left from an earlier rollout under the same id (or sent to an id that did not
    exist yet) names another `published`, and the operator ignores it."""
    return {"action": action, "ts": round(time.time() if ts is None else ts, 3), "by": by,
            "rollout": rollout_id, "published": published, **detail}


def decode(payload: bytes) -> Any:
    try:
        return json.loads(payload) if payload else None
    except (ValueError, UnicodeDecodeError):
        return None
