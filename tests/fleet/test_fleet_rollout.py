"""A fleet rollout end to end on each broker (tests/brokers.py FLEET_BROKERS: Mosquitto, aedes, and a two-node
aedes cluster on Redis with the devices on one node and the operator on the other), real agents on the demo bundle and 200 simulated
devices running the agent's own update code, driven by the `edge-agent fleet` CLI in its own process.

Pins: a 4-phase rollout commits everywhere; the operator SIGKILLed mid-rollout is resumed from the
broker's retained documents with no device commanded twice; one group at 30 % self-test rejections
aborts at the threshold after the minimum count with the other groups untouched; `fleet rollback`
returns every committed device to its previous bundle.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from brokers import FLEET_BROKERS, Collector, fleet_broker
from waiting import wait_until

from agent.bundle.archive import pack
from agent.bundle.signing import keygen, sign_bundle
from agent.fleet.sim_fleet import SimFleet
from agent.fleet.sim_groups import GroupProfile
from agent.testing import rewrite_manifest
from agentproc import AgentProcess, demo_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"
REAL_AGENTS = int(os.environ.get("FLEET_TEST_REAL_AGENTS", "3"))  # fewer on a busier machine: docs/fleet.md


def fleet(world: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-json", "fleet", *args, *broker_args(world)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def broker_args(world: dict) -> list[str]:
    """The operator's node (on a cluster, not the devices' one) and the MQTT version it speaks."""
    return ["--broker", f"127.0.0.1:{world['port']}", "--mqtt-protocol", world["protocol"]]


def retained(world: dict, topic: str) -> dict[str, dict]:
    col = Collector(world["port"], [topic], protocol=world["protocol"])
    try:
        wait_until(lambda: col.connects >= 1, 20)
        # Retained messages arrive at once after SUBACK, flagged retain: wait for them to settle (live ones,
        # facts a device republishes meanwhile, are not counted: they need not ever settle). This returns
        # in the middle of the operator's publishing bursts, so the kill below lands mid-burst too: in 3 of
        # 6 runs (3 December 2026) one device was then left on v1. The likeliest cause: the operator wrote
        # a device's `started` record, then its update command without waiting for the broker (a SIGKILL
        # can drop it from paho's queue), and resume never commanded it again. The command is now
        # acknowledged, then recorded (`commanded`), and resume re-commands a device without it
        # (tests/fleet/test_fleet_operator.py); 8 of 8 runs passed since. (In one failing run the device did
        # commit v2, late: that one this does not explain.)
        n = -1
        while n != (n := sum(1 for m in list(col.messages) if m.retain)):
            time.sleep(0.5)
        return {m.topic: json.loads(m.payload) for m in list(col.messages) if m.payload}
    finally:
        col.close()


@pytest.fixture(scope="module", params=FLEET_BROKERS)
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Broker (each of FLEET_BROKERS: Mosquitto, aedes, a two-node aedes cluster with the devices on one node
    and the operator on the other), HTTP server with signed v2 and v3 of the demo bundle, the real agents."""
    t = tmp_path_factory.mktemp("fleet")
    keygen(t / "k.pem", t / "k.pub")
    web = t / "web"
    web.mkdir()
    archives = {}
    for v in (2, 3):
        src = t / f"v{v}"
        shutil.copytree(DEMO, src)
        # a 1 s latency budget: the host's load is not what this test judges. On 2 shared cores at load 12-30
        # (7 December 2026) the real agents' probation p95 (105-470 ms) went over the demo's 50 ms, they rolled
        # v2 back (4 of 4 runs, 3 on the cluster, 1 on Mosquitto); tests/updates/ judge probation.
        rewrite_manifest(src, lambda m, v=v: m.update(version=v, selftest={**m["selftest"],
                                                                           "latency_budget_ms": {"default": 1000.0}}))
        sign_bundle(src, t / "k.pem")
        archives[v] = pack(src, web / f"v{v}.tar.gz")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(web), **k)
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    broker = fleet_broker(request.param, t / "broker")
    agents = []
    for i in range(REAL_AGENTS):
        d = t / f"real-{i}"
        cfg = demo_config(d, port=broker.device_port, device_id=f"real-{i}", labels={"group": "real", "site": "lab"},
                          source={"max_fps": 15}, output={"stdout": False, "health_interval_s": 5},
                          mqtt={"keepalive": 10, "reconnect_max_s": 2, **broker.agent_mqtt},
                          updates={"enabled": True, "trusted_keys": [str(t / "k.pub")], "probation_s": 2.0,
                                   "probation_frames": 20})
        agents.append(AgentProcess(d, cfg).start())  # a module's agents: the per-test factory does not serve
    col = Collector(broker.device_port, ["edge/+/cmd/update", "edge/+/cmd/rollback"], protocol=broker.protocol)
    assert col.wait(lambda: col.connects >= 1, 20)
    yield {"kind": request.param, "t": t, "port": broker.port, "device_port": broker.device_port, "protocol": broker.protocol, "url": f"http://127.0.0.1:{srv.server_address[1]}", "archives": archives,
           "col": col, "pub": t / "k.pub", "agents": agents}
    col.close()
    for a in agents:
        a.stop()
    srv.shutdown()
    broker.stop()


def link_events(agent: AgentProcess) -> list[str]:
    """A real agent's connects, disconnects and update steps, in order, from its JSON log."""
    keep = ("mqtt.connected", "mqtt.disconnected", "mqtt.superseded_dropped", "update.switched", "update.committed",
            "update.rolled_back", "update.rejected")
    out = []
    for line in agent.log_path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") in keep:
            out.append(f"{e.get('timestamp', '')[11:23]} {e['event']}")
    return out


def wait_real_agents(world: dict, timeout: float = 180) -> None:
    def ready() -> bool:
        facts = retained(world, "edge/+/facts")
        return sum(1 for k, f in facts.items() if k.startswith("edge/real-") and (f.get("proof") or {}).get("passed")) >= REAL_AGENTS
    assert wait_until(ready, timeout, interval=2), "the real agents did not publish facts with a passing self-test"


def sim_fleet(world: dict, groups: list[GroupProfile], name: str) -> SimFleet:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else world["t"]
    return SimFleet("127.0.0.1", world["device_port"], groups, DEMO, [world["pub"]],
                    root / f"edge-fleet-test-{os.getpid()}-{name}-{world['device_port']}", seed=7,
                    protocol=world["protocol"]).start()


def commands(world: dict, kind: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in list(world["col"].messages):
        if m.topic.endswith(f"/cmd/{kind}"):
            d = m.topic.split("/")[1]
            out[d] = out.get(d, 0) + 1
    return out


def test_four_phase_rollout_commits_everywhere_and_survives_its_operator_being_killed(world: dict) -> None:
    groups = [GroupProfile(n, 50, labels={"fleet": "one"}) for n in "abcd"]
    sims = sim_fleet(world, groups, "one")
    try:
        wait_real_agents(world)
        plan = world["t"] / "plan-one.json"
        r = fleet(world, "rollout", "plan", "--bundle", str(world["archives"][2]), "--url", world["url"] + "/v2.tar.gz",
                  "--id", "one", "--canary", "10", "--canary-prefer", "group=real", "--steps", "25,60",
                  "--rate", "900", "--max-downloads", "20", "--device-timeout", "240", "--out", str(plan))
        assert r.returncode == 0, r.stderr
        doc = json.loads(plan.read_text())
        targets = doc["targets"]
        assert len(targets) == 200 + REAL_AGENTS and len(doc["phases"]) == 4, doc["phases"]
        assert all(d.startswith("real-") for d in targets[:REAL_AGENTS]), "the canary takes the real agents first"

        log = open(world["t"] / "operator-1.log", "w")
        op = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "fleet", "rollout", "start", str(plan),
                               *broker_args(world)], cwd=ROOT, stdout=log, stderr=log)
        # killed once the third phase has begun: its in-flight devices finish without it
        third = doc["phases"][1]
        assert wait_until(lambda: len(retained(world, "fleet/rollout/one/device/+")) > third + 5, 240, interval=1)
        op.send_signal(signal.SIGKILL)
        op.wait(10)
        before = len(retained(world, "fleet/rollout/one/device/+"))
        assert before < len(targets), "the operator was killed after it had started every device"

        r = fleet(world, "rollout", "resume", "one", "--force", timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        state = retained(world, "fleet/rollout/one/state")["fleet/rollout/one/state"]
        assert state["status"] == "done" and state["phase"] == 3, state
        events = [d["event"] for d in state["decisions"]]
        assert events.count("phase_advanced") == 3 and "resumed" in events and events[-1] == "done", events
        assert state["gate"]["passed"] and all(c["passed"] for c in state["gate"]["checks"]), state["gate"]

        r = fleet(world, "rollout", "status", "one", "--json")
        doc = json.loads(r.stdout)
        assert doc["state"]["status"] == "done" and len(doc["devices"]) == len(targets), r.stderr[-1000:]
        r = fleet(world, "ls", "--where", "group=real", "--where", "provider=CPUExecutionProvider", "--json")
        rows = json.loads(r.stdout)
        assert sorted(x["device"] for x in rows) == [f"real-{i}" for i in range(REAL_AGENTS)], rows
        # Until 7 December 2026 this failed on the aedes cluster (2 of 2 runs, load 27-47), v1 read for a real
        # agent. Two causes fit and both are gone: its probation over the 50 ms budget rolled v2 back (seen here
        # on 7 December: the same assertion, the agent's log said update.rolled_back; the budget above), or a
        # link that went down between its self-test and its commit, after which paho sent the queued self-test
        # facts (v1 committed) after the connect's current ones (tests/link/test_link_retained_order.py reproduces it
        # on the cluster; fixed in agent/link/superseded.py). Each agent's events say which, if it comes back.
        assert all(x["committed"] == "digits-classifier@2" and x["fidelity_margin"] is not None for x in rows), \
            [(x["device"], x["committed"], x["fidelity_margin"], x.get("availability"),
              link_events(world["agents"][int(x["device"].split("-")[1])])) for x in rows]

        # a device publishes its update verdict, then its facts: the rollout may end on the last verdicts
        # before their facts reach the broker, so the facts are waited for (a barrier), then judged
        def committed_versions() -> dict[str, object]:
            facts = retained(world, "edge/+/facts")
            return {k.split("/")[1]: (f["bundle"]["committed"] or {}).get("version") for k, f in facts.items()}

        # One read of the broker per check: all() over a generator that read it per device made 205 reads of
        # 0.6 s each (two of this test's three minutes).
        wait_until(lambda: all(v.get(d) == 2 for v in [committed_versions()] for d in targets), 150, interval=0.5)
        committed = committed_versions()
        behind = [d for d in targets if committed[d] != 2]
        if behind:  # what each left-behind device's record, retained status and simulator say
            records = retained(world, "fleet/rollout/one/device/+")
            status = retained(world, "edge/+/update/status")
            sim = {d.id: {"commands": d.update_commands, "fate": d.fate} for d in sims.devices if d.id in behind}
            pytest.fail(f"left on an older version: {behind}; records "
                        f"{ {d: records.get(f'fleet/rollout/one/device/{d}') for d in behind} }; status "
                        f"{ {d: status.get(f'edge/{d}/update/status') for d in behind} }; simulator {sim}; links "
                        f"{ {d: link_events(world['agents'][int(d[5:])]) for d in behind if d.startswith('real-')} }")
        # no device commanded twice: what the devices received (sims count), and what the broker carried
        assert all(d.update_commands == 1 for d in sims.devices), [d.id for d in sims.devices if d.update_commands != 1]
        seen = commands(world, "update")
        assert {d for d in targets} == set(seen) and max(seen.values()) == 1, {d: n for d, n in seen.items() if n != 1}
    finally:
        sims.close()
        shutil.rmtree(sims.state_root, ignore_errors=True)


def test_a_group_at_30_percent_rejections_aborts_at_the_threshold_and_fleet_rollback_restores_it(world: dict) -> None:
    groups = [GroupProfile("e", 50, labels={"fleet": "two"}), GroupProfile("f", 50, reject_pct=30, labels={"fleet": "two"}),
              GroupProfile("g", 50, labels={"fleet": "two"}), GroupProfile("h", 50, labels={"fleet": "two"})]
    sims = sim_fleet(world, groups, "two")
    try:
        plan = world["t"] / "plan-two.json"
        r = fleet(world, "rollout", "plan", "--bundle", str(world["archives"][3]), "--url", world["url"] + "/v3.tar.gz",
                  "--id", "two", "--where", "fleet=two", "--canary", "50", "--canary-prefer", "group=f",
                  "--steps", "50,75", "--rate", "900", "--abort-pct", "20", "--abort-min", "10", "--out", str(plan))
        assert r.returncode == 0, r.stderr
        r = fleet(world, "rollout", "start", str(plan), timeout=600)
        assert r.returncode == 1, r.stderr[-2000:]  # not done: aborted
        state = retained(world, "fleet/rollout/two/state")["fleet/rollout/two/state"]
        assert state["status"] == "aborted", state["status"]
        abort = next(d for d in state["decisions"] if d["event"] == "aborted")
        assert abort["finished"] >= 10 and 100.0 * abort["failed"] / abort["finished"] >= 20.0, abort
        # at the threshold: one result fewer would have been under it (or under the minimum count)
        prev_failed, prev_finished = abort["failed"] - 1, abort["finished"] - 1
        assert prev_finished < 10 or 100.0 * prev_failed / prev_finished < 20.0, abort
        assert abort["failures"] == {"rejected_selftest": abort["failed"]}, abort

        records = retained(world, "fleet/rollout/two/device/+")
        started = {k.rsplit("/", 1)[1] for k in records}
        assert started and all(d.startswith("sim-f-") for d in started), sorted(started)[:10]
        untouched = [d for d in sims.devices if d.group.name != "f"]
        assert all(d.update_commands == 0 and d.store.committed_id.startswith("digits-classifier-v1-") for d in untouched)
        committed = [k.rsplit("/", 1)[1] for k, r in records.items() if r["state"] == "committed"]
        assert committed

        r = fleet(world, "rollback", "two", timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        by_id = {d.id: d for d in sims.devices}
        for d in committed:
            assert by_id[d].store.committed_id.startswith("digits-classifier-v1-"), (d, by_id[d].store.committed_id)
            assert by_id[d].rollback_commands == 1
        facts = retained(world, "edge/+/facts")
        assert all(facts[f"edge/{d}/facts"]["bundle"]["committed"]["version"] == 1 for d in committed)
        # a device whose self-test rejected v3 keeps that in its facts, and a new plan for v3 leaves it out
        rejected = [k.rsplit("/", 1)[1] for k, r in records.items() if r.get("kind") == "rejected_selftest"]
        assert facts[f"edge/{rejected[0]}/facts"]["last_failure"]["reason"].startswith("self-test failed")
        r = fleet(world, "rollout", "plan", "--bundle", str(world["archives"][3]), "--url", world["url"] + "/v3.tar.gz",
                  "--id", "two-again", "--where", "fleet=two", "--out", str(world["t"] / "plan-again.json"))
        again = json.loads((world["t"] / "plan-again.json").read_text())["targets"]
        assert not set(rejected) & set(again) and len(again) == 200 - len(rejected), r.stderr[-1500:]
    finally:
        sims.close()
        shutil.rmtree(sims.state_root, ignore_errors=True)
