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

    def device(self, device: str) -> str:
        return self.base + f"device/{device}"

    @property
    def all(self) -> str:
        return self.base + "#"


@dataclass(frozen=True)
class Connection:
    host: str = "127.0.0.1"
    port: int = 1883
    tls_ca: str | None = None
    username: str | None = None
    password: str | None = None
    device_root: str = ROOT


def parse_broker(spec: str) -> tuple[str, int]:
    host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", "1883")
    return host or "127.0.0.1", int(port)


class FleetClient:
    """One operator connection: every message goes to a queue the operator's loop drains; retained
    documents are published QoS 1 and (when asked) waited for until the broker acknowledged them."""

    def __init__(self, conn: Connection, client_id: str | None = None):
        self.conn = conn
        self.inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self.connected = threading.Event()
        self._subs: list[str] = []
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id or f"fleet-{uuid.uuid4().hex[:8]}",
                                  protocol=paho.MQTTv5)
        if conn.tls_ca:
            self.client.tls_set(ca_certs=conn.tls_ca, cert_reqs=ssl.CERT_REQUIRED)
        if conn.username:
            self.client.username_pw_set(conn.username, conn.password)
        self.client.max_inflight_messages_set(200)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload), bool(m.retain)))
        self.client.on_disconnect = lambda *a: self.connected.clear()
        self.client.reconnect_delay_set(1, 5)

    def start(self, topics: list[str], timeout: float = 15.0) -> FleetClient:
        self._subs = topics
        self.client.connect(self.conn.host, self.conn.port, 30)
        self.client.loop_start()
        if not self.connected.wait(timeout):
            raise TimeoutError(f"cannot reach the broker at {self.conn.host}:{self.conn.port}")
        return self

    def _on_connect(self, c: paho.Client, u: Any, f: Any, reason: Any, p: Any) -> None:
        if reason.is_failure:
            return
        if self._subs:
            c.subscribe([(t, 1) for t in self._subs])
        self.connected.set()

    def sync(self, timeout: float = 30.0) -> list[tuple[str, bytes, bool]]:
        """Everything retained under the subscriptions, up to a barrier: the broker delivers what it
        retained for a subscription before a later publish from this same connection."""
        nonce = uuid.uuid4().hex
        marker = f"{FLEET_ROOT}/sync/{nonce}"
        self.client.subscribe(marker, qos=1)
        got: list[tuple[str, bytes, bool]] = []
        deadline = time.monotonic() + timeout
        self.client.publish(marker, b"sync", qos=1)
        while time.monotonic() < deadline:
            try:
                topic, payload, retain = self.inbox.get(timeout=0.5)
            except queue.Empty:
                self.client.publish(marker, b"sync", qos=1)  # a subscription not yet in place missed the first
                continue
            if topic == marker:
                self.client.unsubscribe(marker)
                return got
            got.append((topic, payload, retain))
        raise TimeoutError(f"no sync barrier from the broker within {timeout:g} s")

    def publish(self, topic: str, doc: Any, retain: bool = True, wait: bool = True) -> None:
        payload = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if wait:
            info.wait_for_publish(30)
            if not info.is_published():
                raise TimeoutError(f"the broker did not acknowledge {topic} within 30 s")

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def control_request(rollout_id: str, published: float, action: str, by: str, ts: float | None = None) -> dict[str, Any]:
    """A human request to one rollout, bound to it by its id and the time its plan was published: a
    retained request left from an earlier rollout under the same id (or sent to an id that did not
    exist yet) names another `published`, and the operator ignores it."""
    return {"action": action, "ts": round(time.time() if ts is None else ts, 3), "by": by,
            "rollout": rollout_id, "published": published}


def decode(payload: bytes) -> Any:
    try:
        return json.loads(payload) if payload else None
    except (ValueError, UnicodeDecodeError):
        return None
