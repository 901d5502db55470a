"""`edge-agent monitor`: the operator's live table of every device under a topic root, from their
retained availability and health. A device that says online but whose health stopped arriving is STALE.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho

from agent.link.topics import ROOT

STALE_FACTOR = 3.0  # health older than this many intervals, while online, is stale


@dataclass
class DeviceView:
    device: str
    availability: dict[str, Any] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)

    def row(self, now: float) -> dict[str, Any]:
        h = self.health
        state = self.availability.get("state", "unknown")
        age = round(now - h["ts"], 1) if "ts" in h else None
        interval = float(h.get("interval_s") or 10.0)
        stale = state == "online" and (age is None or age > STALE_FACTOR * interval)
        bundle = h.get("bundle") or {}
        lat = ((h.get("pipeline") or {}).get("latency_ms") or {}).get("total") or {}
        provider = h.get("provider") or {}
        selftest = h.get("selftest") or {}
        return {
            "device": self.device,
            "availability": state,
            "session": self.availability.get("session"),
            "stale": stale,
            "serving": h.get("serving"),
            "bundle": f"{bundle['bundle']}@{bundle['version']}" if bundle else None,
            "variant": h.get("variant"),
            "provider": (provider.get("effective") or [None])[0],
            # health's own word (pass, degraded, fail); an older agent's health has only `passed`
            "verdict": None if not selftest else (selftest.get("verdict") or ("pass" if selftest.get("passed")
                                                                              else "fail")),
            "fps": (h.get("pipeline") or {}).get("fps_out"),
            "p95_ms": lat.get("p95"),
            "outbox": (h.get("outbox") or {}).get("depth"),
            "last_seen_s": age,
        }


class Monitor:
    def __init__(self, host: str, port: int, root: str = ROOT, tls_ca: str | None = None,
                 username: str | None = None, password: str | None = None, insecure: bool = False):
        self.root = root.rstrip("/")
        self.devices: dict[str, DeviceView] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.refused: str | None = None  # the broker's own answer when it refused the connection (not authorised)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        if tls_ca or insecure:
            self.client.tls_set(ca_certs=tls_ca, cert_reqs=ssl.CERT_NONE if insecure else ssl.CERT_REQUIRED)
            self.client.tls_insecure_set(insecure)
        if username:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect_async(host, port, 30)

    def _on_connect(self, c: paho.Client, u: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self.refused = str(reason)
        else:
            c.subscribe([(f"{self.root}/+/availability", 1), (f"{self.root}/+/health", 1)])
            self.connected.set()

    def _on_message(self, c: paho.Client, u: Any, msg: paho.MQTTMessage) -> None:
        parts = msg.topic.split("/")
        if len(parts) < 3:
            return
        device, kind = "/".join(parts[1:-1]), parts[-1]
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            doc = {"state": msg.payload.decode("utf-8", "replace")} if kind == "availability" else {}
        with self.lock:
            view = self.devices.setdefault(device, DeviceView(device))
            setattr(view, kind, doc if isinstance(doc, dict) else {})

    def rows(self) -> list[dict[str, Any]]:
        now = time.time()
        with self.lock:
            return [v.row(now) for _, v in sorted(self.devices.items())]

    def start(self) -> "Monitor":
        self.client.loop_start()
        return self

    def stop(self) -> None:
        self.client.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
        self.client.loop_stop()


def render(rows: list[dict[str, Any]]) -> str:
    head = f"{'device':16} {'state':8} {'bundle':24} {'variant':8} {'provider':10} {'test':8} {'fps':>7} {'p95 ms':>7} {'outbox':>7} {'seen':>6}"
    lines = [head]
    for r in rows:
        state = "STALE" if r["stale"] else r["availability"]
        prov = (r["provider"] or "-").replace("ExecutionProvider", "")
        fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        lines.append(f"{r['device']:16} {state:8} {r['bundle'] or '-':24} {r['variant'] or '-':8} {prov:10} "
                     f"{r['verdict'] or '-':8} {fmt(r['fps'], '7.1f')} {fmt(r['p95_ms'], '7.2f')} "
                     f"{fmt(r['outbox'], '7d')} {fmt(r['last_seen_s'], '5.0f') + 's' if r['last_seen_s'] is not None else '-':>6}")
    return "\n".join(lines)


def unreachable(host: str, port: int, refused: str | None, tls: bool) -> str:
    """Why the broker did not answer, and what to change, as `push` says it: the broker's refusal, else the
    socket's own error (refused, no route, timed out), else an MQTT handshake that never completed."""
    if refused:
        return (f"the broker {host}:{port} refused the connection: {refused}; check --username / --password-file "
                "and the broker's ACL")
    import socket

    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        cause = exc.strerror or type(exc).__name__
        return f"cannot reach the broker {host}:{port}: {cause}; is it running and listening there? (--broker HOST:PORT)"
    return (f"cannot reach the broker {host}:{port}: the port answers but no MQTT connection completed; "
            + ("check --tls-ca (TLS)" if tls else "a TLS port needs --tls-ca") + " and --broker HOST:PORT")


def run_monitor(host: str, port: int, root: str, once: bool, wait_s: float, as_json: bool, **conn: Any) -> int:
    mon = Monitor(host, port, root, **conn).start()
    try:
        if not mon.connected.wait(timeout=max(wait_s, 5.0)):
            print(f"edge-agent: {unreachable(host, port, mon.refused, bool(conn.get('tls_ca') or conn.get('insecure')))}",
                  file=sys.stderr)
            return 1
        time.sleep(wait_s)  # retained messages arrive right after subscribing
        said_empty = False
        while True:
            rows = mon.rows()
            if not rows and not said_empty:  # said once, on stderr: stdout stays the table (or the JSON list)
                print(f"edge-agent monitor: no devices under {root}/<device>/ on {host}:{port} after {wait_s:g} s "
                      "(an agent shows once it has connected; --root names another topic root, --wait waits "
                      "longer)", file=sys.stderr, flush=True)
                said_empty = True
            if as_json:
                print(json.dumps(rows, indent=None if not once else 2))
            else:
                if not once:
                    print("\x1b[2J\x1b[H", end="")
                print(render(rows))
            sys.stdout.flush()
            if once:
                return 0
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        mon.stop()
