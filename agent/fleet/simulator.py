"""Simulated devices: each a real MQTT client on the agent's own topics, running the agent's own update
code (Updater, Downloader, ChunkReceiver, BundleStore, judge_probation) with a model-free engine whose
self-test verdict, figures, timing and failures are drawn from a declared per-group distribution.

What is the agent's code: fetching, hashing, signature check, safe unpack, anti-downgrade, the store
and its symlinks, commit, prune, rollback to the previous committed bundle, the probation judge, the
facts document. What is simulated: the self-test child (a drawn report instead of ONNX Runtime), the
frames on probation (drawn evidence), and the MQTT link's command dispatch (this module: MqttLink runs
two threads and an SQLite outbox per device, which hundreds of devices on two cores cannot afford), on
the same topics and payloads as agent/link/mqtt.py. All clients share one epoll loop thread and one
worker pool, so a thousand devices fit in one process.

This module is the device (its link, updates and commands); the groups and their fates: sim_groups.py; the fleet
in one process and its socket loop: sim_fleet.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from agent import __version__
from agent.bundle.load import Bundle, load_bundle
from agent.config import PayloadError, parse_json_object
from agent.errors import SimulatedCrash
from agent.fleet.facts import device_facts
from agent.fleet.sim_groups import GroupProfile
from agent.fleet.state import mqtt_protocol
from agent.fsio import read_json, write_json_atomic
from agent.link.topics import Topics, default_prefix
from agent.logsetup import get_logger
from agent.proof.terms import CPU
from agent.updates.commands import CommandRefused, Rollback, is_repeat, parse_update_command, repeat_reply
from agent.updates.delivery import ChunkReceiver, Downloader
from agent.updates.probation import ProbationEvidence, ProbationVerdict, judge_probation
from agent.updates.store import BundleStore
from agent.updates.updater import Updater, UpdateRejected
from agent.vocabulary.manifest import MANIFEST_NAME, parse_manifest

if TYPE_CHECKING:
    from agent.fleet.sim_fleet import SimFleet

log = get_logger("fleet.sim")

RECONNECT_S = (0.5, 30.0)  # backoff: first delay, cap (each attempt doubles it, times a jitter of 0.5..1.5)


@dataclass
class _Serving:
    bundle: Bundle
    report: dict[str, Any]


class SimAgent:
    """The ServingAgent the real Updater drives: no engine, only which bundle and report serve."""

    def __init__(self, device: SimDevice, bundle: Bundle, report: dict[str, Any]):
        self.device = device
        self.serving = _Serving(bundle, report)
        self.bundle: Bundle | None = bundle  # what the updater's anti-downgrade check reads

    def serve(self, serving: _Serving) -> None:
        self.serving, self.bundle = serving, serving.bundle

    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[None]:
        yield

    def swap_bundle(self, bundle: Bundle, candidate: Any, report: dict[str, Any]) -> _Serving:
        previous = self.serving
        self.serve(_Serving(bundle, report))
        self.device.publish_facts()
        return previous

    def restore(self, swap: _Serving) -> None:
        self.serve(swap)
        self.device.publish_facts()

    def engine_tally(self, swap: Any) -> None:
        return None

    def watch_probation(self, swap: Any, seconds: float, results: int) -> tuple[Any, float]:
        raise NotImplementedError("simulated devices draw probation (SimUpdater._probation)")

    def stopping(self) -> bool:
        return self.device.fleet.stop.is_set()


class SimUpdater(Updater):
    """The agent's Updater with the two device-bound steps drawn instead of run: the self-test child
    and the frames watched on probation. Every other step is the agent's own code."""

    device: SimDevice

    def _child_selftest(self, root: Path) -> dict[str, Any]:
        d = self.device
        g = d.group
        lo, hi = g.selftest_s
        seconds = d.rng.uniform(lo, hi) * (g.slow_factor if d.slow else 1.0)
        if d.fate == "crash":
            time.sleep(seconds / 2)
            d.crash()
            raise SimulatedCrash(d.id)
        if d.fate == "flaky":
            d.drop_link(g.flaky_down_s)
        if d.fate == "hang":
            d.fleet.stop.wait(g.hang_s)
            raise UpdateRejected("self-test child hung (simulated) and was abandoned")
        time.sleep(seconds)
        if d.fate == "reject":
            return {**d.report(root), "passed": False, "selected": None,
                    "reason": "no candidate passed: fidelity top1_agreement 0.91 under the floor 0.98 (simulated)"}
        return d.report(root, provider=CPU if d.fallback else None)

    def _probation(self, bundle: Bundle, candidate: Any, swap: Any, degraded: bool = False) -> ProbationVerdict:
        d = self.device
        time.sleep(d.group.probation_s)
        bad = d.fate == "rollback"
        return judge_probation(ProbationEvidence(
            seconds=d.group.probation_s, frames=40, results=40, refused=0, inference_errors=3 if bad else 0,
            non_finite=0, inference_p95_ms=d.p95, budget_ms=bundle.manifest.selftest.budget_for(candidate.provider),
            when_too_slow="degraded" if degraded else "none"))


class SimDevice:
    def __init__(self, fleet: SimFleet, device_id: str, group: GroupProfile, fate: str, slow: bool, fallback: bool):
        self.fleet, self.id, self.group, self.fate, self.slow, self.fallback = fleet, device_id, group, fate, slow, fallback
        self.rng = random.Random(f"{fleet.seed}/{device_id}")
        self.topics = Topics(default_prefix(device_id) if fleet.root == "edge" else f"{fleet.root}/{device_id}/")
        self.p95 = round(self.rng.uniform(*group.p95_ms), 3)
        self.margin = round(self.rng.uniform(*group.fidelity_margin), 4)
        self.session = 0
        self.update_commands = 0
        self.rollback_commands = 0
        self.crashed = threading.Event()
        self._link_dropped = False  # drop_link's own disconnect: its timer reconnects, not the backoff
        self._attempts = 0  # failed reconnects since the last connect: the backoff's exponent
        # facts are built and queued under one lock: built on the loop thread (connect) and on worker threads
        # (switch, verdict), an older document queued after a newer one would be the retained one
        self._facts_lock = threading.Lock()
        self.last_update: dict[str, Any] | None = None
        self.url_committed: tuple[str, str] | None = None  # (id, sha256) of the last URL update committed
        self.last_failure: dict[str, Any] | None = None
        self.store = BundleStore(fleet.state_root / device_id / "store")
        bid = fleet.seed_id
        if self.store.committed_id is None:  # seed: hard links of the operator's bundle (never modified)
            dest = self.store.path(bid)
            if not dest.exists():
                shutil.copytree(fleet.seed_copy, dest, copy_function=os.link)
            self.store.commit(bid)
            seeds = read_json(self.store.root / "seeds.json", {}, expect=dict) or {}
            write_json_atomic(self.store.root / "seeds.json", {**seeds, bid: fleet.seed_bundle.manifest_sha256})
        active = load_bundle(self.store.path(self.store.committed_id or bid), check_contracts=False)
        self.agent = SimAgent(self, active, self.report(active.root, provider=group.provider))
        # the serving config is never read: the simulated self-test replaces the child that would use it
        self.updater = SimUpdater(self.agent, self.store, fleet.updates, fleet.state_root / device_id, lambda: None,
                                  self._publish_update)
        self.updater.device = self
        self.receiver, self.downloader = ChunkReceiver(self.updater), Downloader(self.updater)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"edge-agent-{device_id}",
                                  protocol=mqtt_protocol(fleet.protocol))
        self.client.suppress_exceptions = True
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        fleet.loop.attach(self.client)

    # -- what a device reports -----------------------------------------------------------------------------
    def report(self, root: Path, provider: str | None = None) -> dict[str, Any]:
        """A model-free self-test report in the agent's schema, with this device's drawn figures."""
        g = self.group
        prov = provider or g.provider
        m = parse_manifest((root / MANIFEST_NAME).read_text(), str(root))  # the staged bundle's own manifest
        variant = m.variants[0]
        floor = 0.98
        return {
            "schema": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "passed": True,
            "reason": None, "simulated": True,
            "bundle": {"name": m.name, "version": m.version},
            "providers": [{"name": p, "usable": True} for p in dict.fromkeys([g.provider, CPU])],
            "selected": {"provider": prov, "variant": variant.name, "precision": variant.precision},
            "candidates": [{
                "provider": prov, "variant": variant.name, "precision": variant.precision, "options": {},
                "status": "tested", "passed": True, "reasons": [],
                "latency": {"runs": 50, "p50_ms": round(self.p95 / 2, 3), "p95_ms": self.p95, "budget_ms": g.budget_ms},
                "placement": {"nodes_by_provider": {prov: 40}, "partitions": 1},
                "reproduction": {"passed": True, "tolerance": {"abs_diff": 2e-7, "bound": 1e-3}},
                "fidelity": {"passed": True, "metrics": {"top1_agreement": round(min(1.0, floor + self.margin), 4)},
                             "bounds": {"min_top1_agreement": floor}},
            }],
        }

    def facts(self) -> dict[str, Any]:
        s = self.agent.serving
        prov = (s.report.get("selected") or {}).get("provider")
        return device_facts(device_id=self.id, session=self.session, labels={"group": self.group.name, **self.group.labels},
                            versions={"agent": __version__, "onnxruntime": "simulated"}, report=s.report,
                            effective=[prov] if prov else [], current=self.store.current_id,
                            committed=self.store.committed_id, active=None, last_failure=self.last_failure,
                            previous=self.store.previous_committed())

    def publish_facts(self) -> None:
        with self._facts_lock:
            self.client.publish(self.topics.facts, json.dumps(self.facts()), qos=1, retain=True)

    def _publish_update(self, doc: dict[str, Any]) -> None:
        if self.crashed.is_set():
            return  # a dead process publishes nothing
        self.last_update = doc
        self.client.publish(self.topics.update_status, json.dumps(doc), qos=1, retain=True)
        if doc.get("state") in ("committed", "rejected", "rolled_back"):
            if doc["state"] != "committed":
                self.last_failure = doc
            self.publish_facts()

    def _availability(self, state: str, session: int) -> bytes:
        return json.dumps({"state": state, "session": session, "ts": round(time.time(), 3)}).encode()

    # -- connection --------------------------------------------------------------------------------------
    def connect(self) -> None:
        self.client.will_set(self.topics.availability, self._availability("offline", self.session + 1), qos=1, retain=True)
        self.client.connect(self.fleet.host, self.fleet.port, keepalive=60)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        """A link lost (the broker restarted, keepalives missed): reconnect with backoff and jitter, as the
        agent's link does. A crash or drop_link brings its device back itself; a closing fleet stays closed."""
        self.fleet.connected.discard(self.id)
        if self.fleet.stop.is_set() or self.crashed.is_set() or self._link_dropped:
            return
        self._reconnect_later()

    def _reconnect_later(self) -> None:
        first, cap = RECONNECT_S
        delay = min(cap, first * 2 ** self._attempts) * self.rng.uniform(0.5, 1.5)  # jitter: no thundering herd
        self._attempts += 1
        timer = threading.Timer(delay, self._reconnect)
        timer.daemon = True
        timer.start()

    def _reconnect(self) -> None:
        if self.fleet.stop.is_set() or self.crashed.is_set():
            return
        self._link_dropped = False
        try:
            self.connect()
        except OSError:  # the broker is not back yet
            self._reconnect_later()

    def lose_link(self) -> None:
        """End the connection so that the broker publishes the last will. MQTT 5: DISCONNECT with reason 4
        ("with will message"). MQTT 3.1.1 has no such reason (a DISCONNECT discards the will), so the socket
        is shut without one, as a lost link or a dead process leaves it."""
        if self.fleet.protocol == "5":
            self.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, identifier=4))
            return
        sock = self.client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def drop_link(self, seconds: float) -> None:
        """A flaky link: the connection ends with its last will (what a broker does on missed keepalives), the
        device itself goes on; back after `seconds`. What it published meanwhile paho sends on reconnect."""
        self._link_dropped = True
        self.lose_link()
        timer = threading.Timer(seconds, self._reconnect)
        timer.daemon = True
        timer.start()

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            return
        self.session += 1
        self._attempts = 0
        client.publish(self.topics.availability, self._availability("online", self.session), qos=1, retain=True)
        if self.last_update is not None and self.session > 1:  # a verdict reached while away, said again
            client.publish(self.topics.update_status, json.dumps(self.last_update), qos=1, retain=True)
        self.publish_facts()
        client.subscribe([(self.topics.commands, 1), (self.topics.bundle_all, 1)])
        self.fleet.connected.add(self.id)

    def crash(self) -> None:
        """Die mid-update: the broker publishes the last will; back after crash_down_s, booted into the
        committed bundle (the store's recover, as the agent's boot does)."""
        self.crashed.set()
        self.lose_link()

        def reboot() -> None:
            if self.fleet.stop.wait(self.group.crash_down_s):
                return
            self.store.recover()
            self.url_committed = None  # a restarted agent forgets it: the same command again is an update
            active = load_bundle(self.store.path(self.store.committed_id or self.fleet.seed_id), check_contracts=False)
            self.agent.serve(_Serving(active, self.report(active.root)))
            self.crashed.clear()
            self.connect()

        threading.Thread(target=reboot, name=f"reboot-{self.id}", daemon=True).start()

    # -- commands ----------------------------------------------------------------------------------------
    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if msg.topic.startswith(self.topics.prefix + "bundle/"):
            self.receiver.on_message(msg.topic[len(self.topics.prefix):], bytes(msg.payload))
            return
        name = self.topics.command_name(msg.topic)
        if name is None:
            return
        try:
            payload = parse_json_object(bytes(msg.payload), 64 * 1024)
        except PayloadError as exc:
            self.reply(name, payload={}, result={"ok": False, "error": f"malformed payload: {exc}"})
            return
        if name in ("update", "rollback"):
            self._update_command(name, payload)
        elif name == "status":
            self.reply(name, payload, {"ok": True, "facts": self.facts()})
        else:
            self.reply(name, payload, {"ok": False, "error": f"unknown command {name!r} (simulated device: update, "
                                                             "rollback, status)"})

    def _update_command(self, name: str, payload: dict[str, Any]) -> None:
        """`update` and `rollback`, parsed and judged a repeat by the agent's own code (agent.updates.commands)."""
        if name == "update":
            self.update_commands += 1
        else:
            self.rollback_commands += 1
        try:
            cmd = parse_update_command(name, payload)
        except CommandRefused as exc:
            self.reply(name, payload, {"ok": False, "error": str(exc)})
            return
        if isinstance(cmd, Rollback):
            self._job(name, payload, self.updater.begin_rollback(cmd.id), lambda: self.updater.rollback_started(cmd.id))
            return
        if is_repeat(cmd, self.updater.machine.snapshot, self.url_committed, self.store.current_id,
                     self.store.committed_id):  # as the agent's controller answers it
            self.reply(name, payload, repeat_reply(cmd, self.last_update))
            return
        refused = self.downloader.refusal(cmd.url, cmd.id)
        if refused is not None:
            self.reply(name, payload, {"ok": False, "update": refused})
            return
        # the machine is taken here, on the message thread, as the agent's controller takes it: a check
        # here and a BEGIN on the job's thread let a second command through, whose fetch then published
        # "rejected" for the update the first was still installing
        cancel = self.updater.machine.cancel if (busy := self.updater.begin(cmd.id, "url")) is None else None

        def fetch() -> dict[str, Any]:
            result = self.downloader.fetch_started(cmd.url, cmd.sha256, cmd.id, cancel)
            if result.get("state") == "committed":
                self.url_committed = (cmd.id, cmd.sha256)
            return result

        self._job(name, payload, busy, fetch)

    def _job(self, name: str, payload: dict[str, Any], busy: str | None, fn: Any) -> None:
        """`fn` on the pool once the machine took the command (`busy` None), else the busy answer now."""
        if busy is not None:  # the machine is the one guard, as on a real device
            self.reply(name, payload, {"ok": False, "already_running": True, "busy": True,
                                       "error": f"{busy}; send it again after its verdict"})
            return

        def run() -> None:
            try:
                result = fn()
            except SimulatedCrash:
                return
            except Exception as exc:  # a bug in the simulation must cost one device, never the loop
                log.exception("sim.job_failed", device=self.id)
                result = {"state": "rejected", "reason": f"{type(exc).__name__}: {exc}"}
            self.reply(name, payload, {"ok": result.get("state") == "committed", "update": result})

        self.fleet.pool.submit(run)

    def reply(self, name: str, payload: dict[str, Any], result: dict[str, Any]) -> None:
        if self.crashed.is_set():
            return
        cid = payload.get("id")
        body = {"command": name, **({"id": cid} if isinstance(cid, (str, int, float)) else {}), **result}
        self.client.publish(self.topics.reply(name), json.dumps(body), qos=1)
