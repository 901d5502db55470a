"""The broker keeps the document that reached it last, so the link must never send an older retained
document after a newer one of the same topic (issue 47: on the aedes cluster, `fleet ls` read a real
agent's facts as v1 committed after it had committed v2, and the operator had seen its v2 facts).

1. A reconnect: paho keeps every unacknowledged QoS 1 publish and sends it again after a reconnect, after
   what `on_connect` published. The link republishes its current retained documents in `on_connect`, so
   a document queued before the link went down (the self-test's facts: v2 current, v1 committed) reached
   the broker after the current one (v2 committed): the stale one stayed retained.
2. A publish during the connect's republish: the connect builds the documents on paho's thread while
   the controller publishes a newer one; the link said "not connected" to the controller and dropped it,
   then sent its own, older, document.

On a real Mosquitto, and (the first) on the two-node aedes cluster where it was seen (the agent on node B,
the reader on node A), through a TCP relay that can swallow what passes (a link that died silently) and
cut its connections (the death noticed)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from agent.config import MqttConfig
from agent.link.mqtt import MqttLink
from agent.link.outbox import Outbox
from brokers import MOSQUITTO, Broker, Collector, fleet_broker
from waiting import wait_until

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed")

TOPIC = "edge/dev-ro/facts"
MARK = "edge/dev-ro/test-marker"


class Relay:
    """TCP relay to a broker. `swallow()`: bytes still flow in but go nowhere (a dead link that neither side
    noticed yet); `cut()`: close every connection (the death noticed); new connections relay again."""

    def __init__(self, target: int):
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.swallowing = threading.Event()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.swallowing.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def swallow(self) -> None:
        self.swallowing.set()

    def cut(self) -> None:
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.swallowing.clear()

    def close(self) -> None:
        self.server.close()
        self.cut()


def _link(port: int, state: Path, retained, **mqtt) -> MqttLink:  # type: ignore[no-untyped-def]
    cfg = MqttConfig(enabled=True, port=port, keepalive=60, reconnect_min_s=1, reconnect_max_s=1, **mqtt)
    return MqttLink(cfg, "dev-ro", state, Outbox(state / "outbox.sqlite"), lambda cmd: {"ok": True}, retained)


def _settled(link: MqttLink) -> bool:
    """Every QoS 1 publish of the link acknowledged (paho keeps them in a private map: read, never set)."""
    return link.connected.is_set() and not link.client._out_messages


def _retained(link: MqttLink, port: int, protocol: str = "5") -> dict:
    """The retained document as a new reader gets it once the broker stored everything the link sent: the
    link publishes a marker after all its publishes were acknowledged, and the reader waits for it.
    Mosquitto stores a retained message before its PUBACK, aedes after (its Redis write follows the PUBACK),
    but one client's retained writes in the order they came, so the marker comes last on both."""
    assert wait_until(lambda: _settled(link), 30), "the link's publishes were not acknowledged"
    mark = str(time.monotonic()).encode()
    link.publish_retained(MARK, mark)
    col = Collector(port, [TOPIC, MARK], protocol=protocol)
    try:
        assert col.wait(lambda: any(m.payload == mark for m in col.on(MARK)), 20), "the marker never came"
        assert col.wait(lambda: col.on(TOPIC), 5), "no retained document"
        return json.loads(col.on(TOPIC)[-1].payload)
    finally:
        col.close()


@pytest.mark.parametrize("kind", ["mosquitto", "aedes-cluster"])
def test_a_document_queued_before_a_reconnect_is_not_sent_over_the_current_one(tmp_path: Path, kind: str) -> None:
    broker = fleet_broker(kind, tmp_path / "broker")  # the devices' port, and (a cluster) the other node to read
    relay = Relay(broker.device_port)
    state = {"committed": 1, "current": 1}
    link = _link(relay.port, tmp_path / "state", lambda: {TOPIC: json.dumps(state).encode()}, **broker.agent_mqtt)
    try:
        link.start()
        assert _retained(link, broker.port, broker.protocol) == state
        relay.swallow()  # the link is dead and nobody knows yet
        state["current"] = 2  # the update switched: the self-test's facts, lost on the way, kept by paho
        link.publish_retained(TOPIC, json.dumps(state).encode())
        relay.cut()
        assert wait_until(lambda: not link.connected.is_set(), 20)
        state["committed"] = 2  # committed while the link is down: the controller's publish is not sent
        link.publish_retained(TOPIC, json.dumps(state).encode())
        session = link.session
        assert wait_until(lambda: link.session > session, 30), "the link did not come back"
        assert _retained(link, broker.port, broker.protocol) == {"committed": 2, "current": 2}
    finally:
        link.stop(drain_s=0)
        relay.close()
        broker.stop()


def test_a_document_published_while_the_connect_republishes_is_the_one_retained(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    state = {"committed": 1}
    building, go = threading.Event(), threading.Event()

    def retained() -> dict[str, bytes]:
        doc = {TOPIC: json.dumps(state).encode()}  # built from the state of this moment, like the facts
        building.set()
        go.wait(30)  # paho's thread is slow here (a loaded host) while the controller commits
        return doc

    link = _link(broker.port, tmp_path / "state", retained)
    try:
        link.start()
        assert building.wait(30)
        state["committed"] = 2
        controller = threading.Thread(target=link.publish_retained, args=(TOPIC, json.dumps(state).encode()))
        controller.start()
        go.set()
        controller.join(30)
        assert _retained(link, broker.port) == {"committed": 2}
    finally:
        go.set()
        link.stop(drain_s=0)
        broker.stop()
