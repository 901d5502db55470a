"""A broker killed with unsaved state: Mosquitto persists at its autosave interval, so a SIGKILL loses every
rollout record, the rollout's state and the devices' newest documents written since the last save. The devices
still know what they did: on reconnect they publish their facts and last update verdict again. A resumed
operator must reconcile from those: no device's outcome lost, none commanded twice, and the rollback knows each
device's real previous version (its facts' `bundle.previous`), not "any other bundle"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from brokers import Broker, Collector
from waiting import wait_until

from agent.fleet.operator import Operator
from agent.fleet.rollback import FleetRollback
from agent.fleet.plan import Plan
from agent.fleet.sim_fleet import SimFleet
from agent.fleet.sim_groups import GroupProfile
from agent.fleet.state import Connection, FleetClient, RolloutTopics, SyncPolicy
from tests.fleet.test_fleet_operator import publish_plan, serve_v2

pytestmark = [pytest.mark.slow, pytest.mark.idle]  # mostly waiting on reconnects and verdicts

QUICK = SyncPolicy(quiet_s=1.0)
DEVICES = 6


def _operator(port: int, rid: str) -> Operator:
    op = Operator(FleetClient(Connection("127.0.0.1", port, sync=QUICK)), rid, "edge", tick_s=0.05)
    op.client.start(op.topics())
    op.load()
    return op


def _verdicts(port: int, rid: str) -> dict[str, str]:
    col = Collector(port, ["edge/+/update/status"])
    try:
        wait_until(lambda: col.connects >= 1, 20)
        wait_until(lambda: len(col.messages) >= DEVICES, 10)
        return {m.topic.split("/")[1]: json.loads(m.payload).get("state") for m in list(col.messages)
                if m.payload and json.loads(m.payload).get("update") == rid}
    finally:
        col.close()


def test_a_broker_killed_with_unsaved_records_loses_no_outcome_and_rollback_knows_each_previous_version(
        tmp_path: Path, tiny_bundle_master: Path) -> None:
    # the fault: after a broker crash lost the newest records, `resume` started from scratch, commanded a device
    # a second time, recorded the wrong previous version, and the rollback misjudged the device
    broker = Broker(tmp_path / "broker", autosave_s=3600).start()  # saves only when stopped cleanly
    srv, v2 = serve_v2(tmp_path, tiny_bundle_master)
    sims = SimFleet("127.0.0.1", broker.port, [GroupProfile("k", DEVICES)], tiny_bundle_master, [tmp_path / "k.pub"],
                    tmp_path / "sims").start()
    op = None
    try:
        ids = [d.id for d in sims.devices]
        publish_plan(broker.port, Plan(id="lost", artifact=v2, targets=tuple(ids), phases=(DEVICES,),
                                       rate_per_min=6000, device_timeout_s=300))
        broker.stop()  # a clean stop saves: the plan and the devices' facts are on disk, nothing later is
        broker.start()
        assert wait_until(lambda: len(sims.connected) == DEVICES and all(d.session >= 2 for d in sims.devices), 90)

        op = _operator(broker.port, "lost")
        state = op.run(max_s=180)
        assert state["status"] == "done", state.get("decisions")
        assert all(r["state"] == "committed" for r in op.records.values()) and len(op.records) == DEVICES
        op.client.stop()  # the operator is gone too: its records in memory with it
        op = None

        broker.kill()  # unsaved: every record, the rollout's state, the devices' verdicts and new facts
        broker.start()
        # barrier: every device reconnected and said its verdict again (retained), before the resume reads them
        assert wait_until(lambda: len(sims.connected) == DEVICES and all(d.session >= 3 for d in sims.devices), 90)
        assert wait_until(lambda: _verdicts(broker.port, "lost") == {d: "committed" for d in ids}, 60)
        check = FleetClient(Connection("127.0.0.1", broker.port, sync=QUICK)).start([RolloutTopics("lost").all])
        lost = {t for t, _, _ in check.sync()}
        check.stop()
        assert lost == {RolloutTopics("lost").plan}, f"the kill kept more than the saved plan: {sorted(lost)}"

        op = _operator(broker.port, "lost")
        state = op.run(max_s=120)
        assert state["status"] == "done", state.get("decisions")
        assert {d: (r["state"], r.get("reconciled")) for d, r in op.records.items()} == \
            {d: ("committed", True) for d in ids}, op.records
        assert all(d.update_commands == 1 for d in sims.devices), {d.id: d.update_commands for d in sims.devices}
        assert {d: r.get("previous") for d, r in op.records.items()} == \
            {d: {"name": "tiny-classifier", "version": 1} for d in ids}, op.records

        state = FleetRollback(op).run(max_s=120)
        assert {d: (r.get("rollback") or {}).get("state") for d, r in op.records.items()} == \
            {d: "done" for d in ids}, op.records
        assert all(d.store.committed_id == sims.seed_id and d.rollback_commands == 1 for d in sims.devices)
    finally:
        if op is not None:
            op.client.stop()
        sims.close()
        srv.shutdown()
        broker.stop()
