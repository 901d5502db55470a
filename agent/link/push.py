"""`edge-agent push`: the operator's side of an MQTT bundle push.

Offer (name, version, size, sha256, chunk size) -> chunks -> done; resend what the device reports
missing; print every status until the final verdict (committed, rejected or rolled back).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from agent.bundle.archive import unpack
from agent.errors import AgentError
from agent.hashing import sha256_file
from agent.vocabulary.manifest import MANIFEST_NAME, parse_manifest
from agent.link.topics import Topics, default_prefix

FINAL = ("committed", "rejected", "rolled_back")
# How long a device's availability may take to show: retained, it arrives with the subscription; a device that
# is connecting right now publishes it within a moment.
AVAILABILITY_WAIT_S = 5.0


def _manifest_summary(archive: Path) -> dict[str, Any]:
    """Name and version for the offer; an archive this cannot read is still sent: the device decides."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = unpack(archive, Path(tmp) / "b")
            m = parse_manifest((root / MANIFEST_NAME).read_text(), str(archive))
    except (AgentError, OSError) as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return {}
    return {"name": m.name, "version": m.version, "label": m.label}


def push(archive: Path, device: str, host: str, port: int, prefix: str | None = None, chunk_size: int = 256 * 1024,
         timeout_s: float = 600.0, drop_chunks: set[int] | None = None,
         availability_wait_s: float = AVAILABILITY_WAIT_S, **conn: Any) -> dict[str, Any]:
    """Push and wait for the verdict. `drop_chunks` leaves chunks out of the first pass (tests a resume)."""
    topics = Topics(prefix or default_prefix(device))
    data = archive.read_bytes()
    transfer = uuid.uuid4().hex[:12]
    statuses: list[dict[str, Any]] = []
    cond = threading.Condition()

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    if conn.get("tls_ca"):
        client.tls_set(ca_certs=conn["tls_ca"])
    if conn.get("username"):
        client.username_pw_set(conn["username"], conn.get("password"))
    connected = threading.Event()
    availability: dict[str, Any] = {}
    seen = threading.Event()

    def on_connect(c: paho.Client, u: Any, f: Any, reason: Any, p: Any) -> None:
        if not reason.is_failure:
            c.subscribe(topics.update_status, qos=1)
            c.subscribe(topics.availability, qos=1)
            connected.set()

    def on_message(c: paho.Client, u: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic == topics.availability:
            try:
                availability.update(json.loads(msg.payload))
            except ValueError:
                availability.update(state="unreadable")
            seen.set()
            return
        doc = json.loads(msg.payload)
        if doc.get("update") != transfer:
            return  # a retained status of an earlier update
        with cond:
            statuses.append(doc)
            cond.notify_all()
        print(f"{doc.get('step', doc['state']):16} " + " ".join(
            f"{k}={v}" for k, v in doc.items() if k not in ("update", "origin", "state", "step", "ts")),
              file=sys.stderr, flush=True)

    client.on_connect, client.on_message = on_connect, on_message
    client.max_inflight_messages_set(100)
    client.connect(host, port, 30)
    client.loop_start()
    try:
        if not connected.wait(10):
            raise TimeoutError(f"cannot reach the broker at {host}:{port}")
        # a mistyped device id would otherwise wait the whole --timeout in silence: every agent keeps its
        # availability retained (online, stopped, or offline as its last will) from its first connection on
        if not seen.wait(availability_wait_s):
            raise AgentError(f"no device {device!r} on the broker {host}:{port}: nothing retained on "
                             f"{topics.availability}; check --device (and --prefix); `edge-agent monitor --once` "
                             "lists the devices the broker knows")
        if availability.get("state") != "online":
            print(f"warning: {device} is {availability.get('state')}: the push waits for it to come back "
                  f"(--timeout {timeout_s:g} s)", file=sys.stderr, flush=True)
        chunks = (len(data) + chunk_size - 1) // chunk_size
        offer = {"transfer": transfer, **_manifest_summary(archive), "size": len(data),
                 "sha256": sha256_file(archive), "chunk_size": chunk_size, "chunks": chunks}
        client.publish(topics.bundle_offer, json.dumps(offer), qos=1).wait_for_publish(10)

        def send(indices: list[int]) -> None:
            infos = [client.publish(topics.bundle_chunk(transfer, i), data[i * chunk_size:(i + 1) * chunk_size], qos=1)
                     for i in indices]
            for info in infos:
                info.wait_for_publish(30)
            client.publish(topics.bundle_done, json.dumps({"transfer": transfer}), qos=1).wait_for_publish(10)

        send([i for i in range(chunks) if i not in (drop_chunks or set())])
        handled = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with cond:
                cond.wait_for(lambda: len(statuses) > handled, timeout=1.0)
                new, handled = statuses[handled:], len(statuses)
            for doc in new:
                if doc["state"] in FINAL:
                    return doc
                # the step names the chunks to resend; an agent before 7 December 2026 said it as its state
                if doc.get("step", doc["state"]) == "missing":
                    send(doc["chunks"])  # resume: only what did not arrive
        raise TimeoutError(f"no verdict from {device} within {timeout_s:g} s")
    finally:
        client.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
        client.loop_stop()
