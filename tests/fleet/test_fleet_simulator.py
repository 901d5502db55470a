"""The simulated fleet answers commands as the agent does: its update machine is the one guard, taken on the
message thread, so a second command while one runs is answered "busy" and never touches the first."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from brokers import Broker
from waiting import wait_until

from agent.bundle.signing import keygen
from agent.fleet.sim_fleet import SimFleet
from agent.fleet.sim_groups import GroupProfile


@pytest.fixture
def broker(tmp_path: Path):
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


def _message(topic: str, payload: dict) -> paho.MQTTMessage:
    msg = paho.MQTTMessage(topic=topic.encode())
    msg.payload = json.dumps(payload).encode()
    return msg


def test_a_second_update_command_while_the_first_waits_for_a_worker_is_answered_busy(
        broker: Broker, tmp_path: Path, tiny_bundle_master: Path) -> None:
    # The old guard looked at the machine and left BEGIN to the job's thread: with the worker pool busy,
    # both commands passed it, and the second's fetch then published "rejected" for the update the first
    # was about to install.
    keygen(tmp_path / "k.pem", tmp_path / "k.pub")
    sims = SimFleet("127.0.0.1", broker.port, [GroupProfile("a", 1)], tiny_bundle_master, [tmp_path / "k.pub"],
                    tmp_path / "sims", workers=1).start()
    release = threading.Event()
    try:
        dev = sims.devices[0]
        replies: list[dict] = []
        statuses: list[dict] = []
        dev.reply = lambda name, payload, result: replies.append({"command": name, **result})  # type: ignore[method-assign]
        publish = dev.updater.publish
        dev.updater.publish = lambda doc: (statuses.append(doc), publish(doc))  # type: ignore[method-assign]
        sims.pool.submit(release.wait, 60)  # the only worker is taken: no job starts until released
        cmd = {"id": "u1", "url": "http://127.0.0.1:9/v2.tar.gz", "sha256": "ab" * 32}
        dev._on_message(dev.client, None, _message(dev.topics.command("update"), cmd))
        dev._on_message(dev.client, None, _message(dev.topics.command("update"), cmd))
        assert [r.get("busy") for r in replies] == [True], replies
        release.set()
        # the first runs to its own verdict (nothing listens on port 9): one download, one rejection
        assert wait_until(lambda: len(replies) == 2, 60), replies
        assert replies[1]["update"]["state"] == "rejected" and "busy" not in replies[1]["update"].get("reason", "")
        assert [s["state"] for s in statuses].count("rejected") == 1, statuses
        assert dev.update_commands == 2
    finally:
        release.set()
        sims.close()


def test_simulated_devices_reconnect_after_a_broker_restart(broker: Broker, tmp_path: Path,
                                                            tiny_bundle_master: Path) -> None:
    # the fault: a simulated device never reconnected, so a fleet could not test a broker restart or a
    # flaky link, and on a loaded host its devices silently left the fleet
    keygen(tmp_path / "k.pem", tmp_path / "k.pub")
    sims = SimFleet("127.0.0.1", broker.port, [GroupProfile("a", 3)], tiny_bundle_master, [tmp_path / "k.pub"],
                    tmp_path / "sims").start()
    try:
        broker.kill()
        assert wait_until(lambda: not sims.connected, 30), sims.connected
        broker.start()
        assert wait_until(lambda: len(sims.connected) == 3, 60), sims.connected
        assert all(d.session >= 2 for d in sims.devices), [d.session for d in sims.devices]
    finally:
        sims.close()
