"""Where a self-test report comes from: a report.json, a state directory, or a device's retained
`selftest` topic on a broker."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.logsetup import get_logger
from agent.link.topics import Topics, default_prefix

log = get_logger("report")


def _parse(data: bytes | str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise AgentError(f"{where}: not a JSON self-test report: {exc}") from exc
    if not isinstance(doc, dict) or "candidates" not in doc:
        raise AgentError(f"{where}: not a self-test report (expected an object with 'candidates'; "
                         "write one with `edge-agent selftest --bundle DIR`)")
    return doc


def _serving_report(state: Path) -> dict[str, Any] | None:
    """In a state directory whose store serves a bundle: the newest report of that bundle. An update's or
    rollback's proof runs in update-selftest/ (the controller serves that report, and health and /metrics
    show it), so the boot's selftest/report.json may describe a bundle that no longer serves."""
    current = state / "store" / "current"
    try:
        sha = hashlib.sha256((current / "bundle.yaml").read_bytes()).hexdigest()
    except OSError:
        return None
    best: dict[str, Any] | None = None
    for p in (state / "selftest" / "report.json", state / "update-selftest" / "selftest" / "report.json"):
        if not p.is_file():
            continue
        doc = _parse(p.read_bytes(), str(p))
        b = doc.get("bundle")
        b = b if isinstance(b, dict) else {}
        if b.get("manifest_sha256") == sha and (best is None or str(doc.get("created", "")) > str(best.get("created", ""))):
            best = doc
    if best is not None and not Path(str(best["bundle"].get("path", ""))).is_dir():
        best["bundle"] = {**best["bundle"], "path": str(current.resolve())}  # proven in staging, now in the store
    return best


def load_report(path: Path) -> dict[str, Any]:
    """A report.json, or a state directory holding selftest/report.json (or, with a bundle store, the
    report of the bundle the store serves)."""
    if not path.exists():
        raise AgentError(f"{path}: no such file or directory; pass a report.json (the self-test writes "
                         "<state_dir>/selftest/report.json) or a state directory")
    if path.is_dir():
        served = _serving_report(path)
        if served is not None:
            return served
    candidates = [path] if path.is_file() else [path / "selftest" / "report.json", path / "report.json"]
    for p in candidates:
        if p.is_file():
            return _parse(p.read_bytes(), str(p))
    raise AgentError(f"{path}: no self-test report here (looked for {', '.join(str(p) for p in candidates)}); "
                     "pass a report.json or a state directory")


HEALTH_GRACE_S = 1.0  # retained messages arrive together after SUBACK: a short wait for health after the report


def _parse_health(data: bytes | str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise AgentError(f"{where}: not a JSON health message: {exc}") from exc
    if isinstance(doc, dict) and isinstance(doc.get("health"), dict):
        doc = doc["health"]  # the `status` command's reply: {"ok": true, "health": {...}}
    if not isinstance(doc, dict) or not ({"audit", "reproof", "serving"} & set(doc)):
        raise AgentError(f"{where}: not a health message (expected an object with 'serving', 'audit' or "
                         "'reproof': the retained edge/<device>/health topic, or the `status` command's reply)")
    return doc


def load_health(path: Path) -> dict[str, Any]:
    """A saved health message (or `status` reply) for the page's "while serving" section."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AgentError(f"--health {path}: {exc.strerror or exc}") from exc
    return _parse_health(data, f"--health {path}")


def fetch_retained(host: str, port: int, device: str, prefix: str | None = None, timeout_s: float = 10.0,
                   username: str | None = None, password: str | None = None, tls_ca: str | None = None) -> dict[str, Any]:
    """The device's retained self-test report from the broker."""
    return fetch_device(host, port, device, prefix, timeout_s, username, password, tls_ca)[0]


def fetch_device(host: str, port: int, device: str, prefix: str | None = None, timeout_s: float = 10.0,
                 username: str | None = None, password: str | None = None,
                 tls_ca: str | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The device's retained self-test report and, when it is there, its retained health message."""
    import paho.mqtt.client as paho

    topics = Topics(prefix or default_prefix(device))
    topic, health_topic = topics.selftest, topics.health
    got: dict[str, bytes] = {}
    done, both = threading.Event(), threading.Event()
    failed: list[str] = []

    def on_connect(c: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            failed.append(str(reason))
            done.set()
            both.set()
        else:
            c.subscribe([(topic, 1), (health_topic, 1)])

    def on_message(c: Any, u: Any, msg: Any) -> None:
        got["payload" if msg.topic == topic else "health"] = msg.payload
        if "payload" in got:
            done.set()
        if "payload" in got and "health" in got:
            both.set()

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    if tls_ca:
        client.tls_set(ca_certs=tls_ca)
    if username:
        client.username_pw_set(username, password)
    client.on_connect, client.on_message = on_connect, on_message
    try:
        client.connect(host, port, 30)
    except OSError as exc:
        raise AgentError(f"cannot reach the broker at {host}:{port}: {exc}") from exc
    client.loop_start()
    try:
        if done.wait(timeout_s):
            both.wait(HEALTH_GRACE_S)
    finally:
        client.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
        client.loop_stop()
    if failed:
        raise AgentError(f"broker {host}:{port} refused the connection: {failed[0]}")
    if "payload" not in got:
        raise AgentError(f"no retained self-test report on {topic} at {host}:{port} within {timeout_s:g} s "
                         "(is the device id right, and has it run its self-test with MQTT on?)")
    health = None
    if "health" in got:
        try:
            health = _parse_health(got["health"], f"{host}:{port} {health_topic}")
        except AgentError as exc:  # the report is what was asked for: a damaged health costs its section only
            log.warning("report.health_unreadable", error=str(exc)[:300])
    return _parse(got["payload"], f"{host}:{port} {topic}"), health
