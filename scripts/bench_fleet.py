"""Fleet rollout at scale: N simulated devices (default 1000) against one real broker, one operator, then a
rollback of the same fleet. `--broker-kind`: mosquitto (default), aedes (Node.js, MQTT 3.1.1), or
aedes-cluster (two aedes nodes on one Redis: the devices on one node, the operator on the other).

Measures: time to roll out to all, peak RSS and CPU of the broker, the operator and the simulator
(from /proc), MQTT messages per device (every application message, counted by a subscriber on `#`), the rate cap (most devices
started in any 60 s window, from the rollout's retained device records) and, as the physical limit
for the same number of messages, the raw broker rate: one publisher -> one subscriber, QoS 1.

  PYTHONPATH=. python scripts/bench_fleet.py --devices 1000 --rate 600 --json bench_fleet.json

Also: the time each phase began (from the rollout's decisions), update commands per device (every one the
broker carried, counted per device: the target is exactly 1), the operator's first decisions
(`first_decisions`, seconds after it was launched), and the rollback's time, CPU and RSS. With `--json`, the
operator's, the rollback's and the simulator's logs are kept beside it (`NAME.operator.log`, ...).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.bundle.archive import pack
from agent.bundle.signing import keygen, sign_bundle
from agent.testing import rewrite_manifest

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_sample(pid: int) -> tuple[float, float]:
    """(RSS MiB, CPU seconds) of one process."""
    try:
        rss = next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS")) / 1024
        st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return rss, (int(st[11]) + int(st[12])) / TICK
    except (OSError, StopIteration):
        return 0.0, 0.0


class Sampler(threading.Thread):
    def __init__(self, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.pids, self.peak = pids, {k: 0.0 for k in pids}
        self.cpu0 = {k: proc_sample(p)[1] for k, p in pids.items()}
        self.cpu1 = dict(self.cpu0)
        self.peak_cpu_pct = {k: 0.0 for k in pids}
        self.stop = threading.Event()

    def run(self) -> None:
        last = {k: (time.monotonic(), self.cpu0[k]) for k in self.pids}
        while not self.stop.wait(1.0):
            for k, p in self.pids.items():
                rss, cpu = proc_sample(p)
                if cpu:
                    self.cpu1[k] = cpu
                self.peak[k] = max(self.peak[k], rss)
                t0, c0 = last[k]
                now = time.monotonic()
                self.peak_cpu_pct[k] = max(self.peak_cpu_pct[k], 100 * (cpu - c0) / max(now - t0, 1e-6))
                last[k] = (now, cpu)


class MessageCounter:
    """Every application message the broker carries (a subscriber on `#`), by kind: what a rollout costs."""

    def __init__(self, port: int, protocol: str = "5"):
        self.lock = threading.Lock()
        self.by_kind: dict[str, int] = {}
        self.commands: dict[str, dict[str, int]] = {"update": {}, "rollback": {}}  # per device
        self.bytes = 0
        self.counting = False
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2,
                             protocol=paho.MQTTv5 if protocol == "5" else paho.MQTTv311)
        self.c.on_message = self._on_message
        self.subscribed = threading.Event()
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.on_connect = lambda c, u, f, r, p: c.subscribe("#", qos=0)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.subscribed.wait(10)

    def _on_message(self, c: paho.Client, u: object, m: paho.MQTTMessage) -> None:
        if not self.counting or m.retain:  # retained copies replayed on subscribe are not traffic
            return
        parts = m.topic.split("/")
        kind = parts[0] + "/" + ("/".join(parts[2:]) if parts[0] == "edge" else "/".join(parts[3:4]))
        with self.lock:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            self.bytes += len(m.payload)
            if parts[0] == "edge" and len(parts) == 4 and parts[2] == "cmd" and parts[3] in self.commands:  # not .../reply
                per = self.commands[parts[3]]
                per[parts[1]] = per.get(parts[1], 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.by_kind.values())


def tiny_bundles(d: Path) -> tuple[Path, Path, Path]:
    """v1 (the seed, unsigned like the demo) and a signed v2 archive of a tiny real classifier bundle."""
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_classifier, structured_frames

    d.mkdir(parents=True, exist_ok=True)
    spec = {"name": "tiny-classifier", "version": 1, "label": "0.1.0", "task": "classification",
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch", "interpolation": "linear"},
                           "color": "rgb", "scale": 1 / 255, "mean": [0.5] * 3, "std": [0.25] * 3,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": {"type": "classification", "output": "logits", "top_k": 2}}
    np.savez_compressed(d / "calib.npz", raw=structured_frames(48, 40, 1))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(8, 40, 2))
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    (d / "labels.txt").write_text("a\nb\nc\nd\n")
    v1 = create_bundle(CreateOptions(out=d / "v1", model=make_tiny_classifier(d / "tiny.onnx"), spec=d / "spec.yaml",
                                     calibration=d / "calib.npz", golden=d / "golden.npz", labels=d / "labels.txt",
                                     min_agreement=0.5))
    keygen(d / "k.pem", d / "k.pub")
    shutil.copytree(v1, d / "v2")
    rewrite_manifest(d / "v2", lambda m: m.update(version=2))
    sign_bundle(d / "v2", d / "k.pem")
    (d / "web").mkdir()
    return v1, pack(d / "v2", d / "web" / "v2.tar.gz"), d / "k.pub"


def demo_bundles(d: Path) -> tuple[Path, Path, Path]:
    demo = ROOT / "models" / "digits-classifier"
    keygen(d / "k.pem", d / "k.pub")
    shutil.copytree(demo, d / "v2")
    rewrite_manifest(d / "v2", lambda m: m.update(version=2))
    sign_bundle(d / "v2", d / "k.pem")
    (d / "web").mkdir()
    return demo, pack(d / "v2", d / "web" / "v2.tar.gz"), d / "k.pub"


def raw_rate(port: int, count: int, size: int) -> tuple[float, str]:
    """Seconds for the broker to carry `count` QoS 1 messages of `size` bytes from one publisher to one
    subscriber: mosquitto_pub -l / mosquitto_sub -C (C clients, so the broker is what is measured), else paho."""
    pub_bin, sub_bin = shutil.which("mosquitto_pub"), shutil.which("mosquitto_sub")
    if pub_bin and sub_bin:
        sub = subprocess.Popen([sub_bin, "-p", str(port), "-t", "bench/raw", "-q", "1", "-C", str(count)],
                               stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # subscribed
        line = ("x" * max(1, size - 1) + "\n").encode()
        t0 = time.monotonic()
        pub = subprocess.Popen([pub_bin, "-p", str(port), "-t", "bench/raw", "-q", "1", "-l"], stdin=subprocess.PIPE)
        assert pub.stdin is not None
        pub.stdin.write(line * count)
        pub.stdin.close()
        sub.wait(600)
        dt = time.monotonic() - t0
        pub.wait(30)
        return dt, "mosquitto_pub -l -> mosquitto -> mosquitto_sub, QoS 1"
    got = threading.Event()
    n = [0]
    subc = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    subscribed = threading.Event()

    def on_msg(c, u, m):
        n[0] += 1
        if n[0] >= count:
            got.set()

    subc.on_message = on_msg
    subc.on_subscribe = lambda *a: subscribed.set()
    subc.on_connect = lambda c, u, f, r, p: c.subscribe("bench/raw", qos=1)
    subc.connect("127.0.0.1", port)
    subc.loop_start()
    subscribed.wait(10)
    pubc = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    pubc.max_inflight_messages_set(200)
    pubc.connect("127.0.0.1", port)
    pubc.loop_start()
    payload = b"x" * size
    t0 = time.monotonic()
    for _ in range(count):
        pubc.publish("bench/raw", payload, qos=1)
    got.wait(600)
    dt = time.monotonic() - t0
    for c in (pubc, subc):
        c.loop_stop()
        c.disconnect()
    return dt, "paho -> mosquitto -> paho, QoS 1"


def bench_read(devices: int, out: Path | None) -> int:
    """`--read-only`: how long reading the retained fleet takes (what `ls`, `plan`, `status` and `resume`
    do first) for `devices` devices' retained documents (facts of a real size, availability, update
    status), published quickly by one client: no simulated agents. The read runs `fleet ls --json` in
    its own process with the default quiet-period rule (docs/fleet.md)."""
    import resource

    from agent.fleet.facts import device_facts
    from agent.fleet.state import Connection, FleetClient

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-read-"))
    procs: list[subprocess.Popen] = []
    port = start_broker("mosquitto", work, procs)[0]
    broker = procs[0]
    try:
        c = FleetClient(Connection("127.0.0.1", port)).start([])
        t0 = time.monotonic()
        docs = 0
        for i in range(devices):
            d = f"dev{i:05d}"
            facts = device_facts(device_id=d, session=1, labels={"group": "g"}, versions={"agent": "0", "onnxruntime": "1"},
                                 report=None, effective=["CPUExecutionProvider"], current="tiny-classifier-v1-0123456789ab",
                                 committed="tiny-classifier-v1-0123456789ab", active=None, last_failure=None)
            for topic, doc in ((f"edge/{d}/facts", facts), (f"edge/{d}/availability", {"state": "online", "session": 1}),
                               (f"edge/{d}/update/status", {"update": "r0", "state": "committed", "ts": 1.0})):
                c.publish(topic, doc, wait=(i == devices - 1 and topic.endswith("status")))
                docs += 1
        publish_s = time.monotonic() - t0
        c.stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "agent", "--log-level", "warning", "fleet", "ls", "--json", "--broker",
                            f"127.0.0.1:{port}"], cwd=ROOT, env=env, capture_output=True, text=True)
        read_s = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        seen = len(json.loads(r.stdout)) if r.returncode == 0 else None
        result = {"devices": devices, "retained_documents": docs, "publish_s": round(publish_s, 2),
                  "ls_wall_s": round(read_s, 2), "ls_cpu_s": round((after.ru_utime + after.ru_stime)
                                                                     - (before.ru_utime + before.ru_stime), 2),
                  "ls_devices_seen": seen, "ls_error": r.stderr[-500:] if r.returncode else None,
                  "bound_s": round(30 + 0.05 * docs), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
        print(json.dumps(result, indent=1))
        if out:
            out.write_text(json.dumps(result, indent=1))
        return 0 if seen == devices else 1
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def start_broker(kind: str, work: Path, procs: list[subprocess.Popen]) -> tuple[int, int, str, dict[str, int]]:
    """(operator's port, devices' port, MQTT version, {name: pid} to sample) of a started broker of `kind`."""
    if kind == "mosquitto":
        port = free_port()
        (work / "mosquitto.conf").write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n"
                                             "max_queued_messages 0\nmax_inflight_messages 0\npersistence false\n"
                                             + ("user root\n" if os.geteuid() == 0 else ""))
        broker = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(work / "mosquitto.conf")],
                                  stdout=subprocess.DEVNULL, stderr=open(work / "mosquitto.log", "w"))
        procs.append(broker)
        time.sleep(0.5)
        return port, port, "5", {"broker": broker.pid}
    sys.path.insert(0, str(ROOT / "tests"))
    from brokers import AedesBroker, AedesCluster, aedes_missing

    missing = aedes_missing()
    if missing:
        raise SystemExit(f"--broker-kind {kind}: {missing}")
    if kind == "aedes":
        b = AedesBroker(work / "aedes").start()
        assert b.proc is not None
        procs.append(b.proc)
        return b.port, b.port, b.protocol, {"broker": b.proc.pid}
    c = AedesCluster(work / "cluster").start()
    procs += [n.proc for n in c.nodes if n.proc] + ([c.redis] if c.redis else [])
    assert c.redis is not None and all(n.proc for n in c.nodes)
    return c.port, c.device_port, c.protocol, {"broker": c.nodes[0].proc.pid, "broker_b": c.nodes[1].proc.pid,  # type: ignore[union-attr]
                                               "redis": c.redis.pid}


def read_rollout(port: int, protocol: str, rid: str) -> dict[str, object]:
    from agent.fleet.state import Connection, FleetClient, decode

    fc = FleetClient(Connection("127.0.0.1", port, protocol=protocol)).start([f"fleet/rollout/{rid}/#"])
    docs = {t: decode(p) for t, p, _ in fc.sync()}
    fc.stop()
    return docs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=600.0, help="devices started per minute (the plan's cap)")
    ap.add_argument("--max-downloads", type=int, default=50)
    ap.add_argument("--bundle", choices=["tiny", "demo"], default="tiny")
    ap.add_argument("--broker-kind", choices=["mosquitto", "aedes", "aedes-cluster"], default="mosquitto")
    ap.add_argument("--no-rollback", action="store_true", help="the rollout only")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--read-only", action="store_true", help="only time reading N devices' retained documents")
    args = ap.parse_args()
    if args.read_only:
        return bench_read(args.devices, args.json)
    from agent.logsetup import configure_logging

    configure_logging("warning", True)
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    procs: list[subprocess.Popen] = []
    try:
        seed, archive, pub = (tiny_bundles if args.bundle == "tiny" else demo_bundles)(work / "bundles")
        port, dev_port, protocol, pids = start_broker(args.broker_kind, work, procs)
        web = archive.parent
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(web), **k)
        http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}/v2.tar.gz"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cli = [sys.executable, "-m", "agent", "--log-level", "warning", "--log-json", "fleet"]
        op_broker = ["--broker", f"127.0.0.1:{port}", "--mqtt-protocol", protocol]
        groups = "a:25;b:25;c:25;d:25"
        sim = subprocess.Popen(cli + ["simulate", "--devices", str(args.devices), "--groups", groups, "--seed-bundle",
                                      str(seed), "--trusted-key", str(pub), "--state-root", str(shm),
                                      "--broker", f"127.0.0.1:{dev_port}", "--mqtt-protocol", protocol],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(work / "sim.log", "w"), text=True)
        procs.append(sim)
        t_setup = time.monotonic()
        line = sim.stdout.readline() if sim.stdout else ""  # {"event": "sim.ready", ...} once every device connected
        if not line:
            raise SystemExit(f"the simulator ended: {(work / 'sim.log').read_text()[-2000:]}")
        ready = json.loads(line)
        setup_s = time.monotonic() - t_setup
        counter = MessageCounter(dev_port, protocol)
        plan = work / "plan.json"
        t_plan = time.monotonic()
        r = subprocess.run(cli + ["rollout", "plan", "--bundle", str(archive), "--url", url, "--id", "bench",
                                  "--canary", "10", "--steps", "10,50", "--rate", str(args.rate),
                                  "--max-downloads", str(args.max_downloads), "--device-timeout", "600",
                                  "--out", str(plan), *op_broker],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        plan_s = time.monotonic() - t_plan
        assert r.returncode == 0, r.stderr
        planned = len(json.loads(plan.read_text())["targets"])
        counter.counting = True
        load_start = os.getloadavg()
        t0 = time.monotonic()
        wall0 = time.time()
        op = subprocess.Popen(cli + ["rollout", "start", str(plan), *op_broker], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=open(work / "operator.log", "w"))
        procs.append(op)
        sampler = Sampler({**pids, "operator": op.pid, "simulator": sim.pid})
        sampler.start()
        op.wait()
        rollout_s = time.monotonic() - t0
        sampler.stop.set()
        load_end = os.getloadavg()
        time.sleep(1.0)  # the last verdicts' facts and replies
        counter.counting = False
        received = counter.total()
        avg_size = counter.bytes // max(received, 1)
        # the rollout's own record of when each device started: the rate cap, measured
        docs = read_rollout(port, protocol, "bench")
        state = docs.get("fleet/rollout/bench/state") or {}
        assert isinstance(state, dict)
        phase_began = {0: 0.0}
        first_decisions = []  # what the operator decided in its first phases, seconds after it was started
        for d in state.get("decisions") or []:
            if d.get("event") == "phase_advanced":
                phase_began[int(d["phase"])] = round(float(d["ts"]) - wall0, 1)
            if len(first_decisions) < 8:
                first_decisions.append({k: (round(float(v) - wall0, 1) if k == "ts" else v) for k, v in d.items()})
        starts = sorted(d["started"] for t, d in docs.items() if "/device/" in t and isinstance(d, dict) and "started" in d)
        j, max_per_min = 0, 0
        for i, s in enumerate(starts):
            while starts[j] < s - 60.0:
                j += 1
            max_per_min = max(max_per_min, i - j + 1)
        committed = sum(1 for t, d in docs.items() if "/device/" in t and isinstance(d, dict) and d.get("state") == "committed")
        if state.get("status") != "done":
            print(f"the rollout did not finish: operator log {(work / 'operator.log').read_text()[-3000:]}", file=sys.stderr)
        upd = dict(counter.commands["update"])
        res: dict[str, object] = {
            "broker_kind": args.broker_kind, "mqtt_protocol": protocol,
            "devices": args.devices, "bundle": args.bundle, "archive_bytes": archive.stat().st_size,
            "rate_cap_per_min": args.rate, "max_downloads": args.max_downloads,
            "sim_connect_s": ready.get("connect_s"), "sim_setup_s": round(setup_s, 1),
            "plan_s": round(plan_s, 1), "plan_targets": planned,
            "rollout_s": round(rollout_s, 1), "status": state.get("status"), "committed": committed,
            "phase_began_s": phase_began, "first_decisions": first_decisions,
            "counts": state.get("counts"), "max_started_in_60s": max_per_min,
            "update_commands": sum(upd.values()), "devices_commanded": len(upd),
            "update_commands_per_device_max": max(upd.values(), default=0),
            "devices_commanded_more_than_once": sum(1 for n in upd.values() if n > 1),
            "msgs_published": int(received), "msgs_per_device": round(received / args.devices, 1),
            "msgs_by_kind": dict(sorted(counter.by_kind.items())), "avg_payload_bytes": avg_size,
            "rollout_msgs_per_s": round(received / rollout_s),
            "ideal_rollout_s_at_rate_cap": round(60.0 * args.devices / args.rate, 1),
            "peak_rss_mib": {k: round(v, 1) for k, v in sampler.peak.items()},
            "cpu_s": {k: round(sampler.cpu1[k] - sampler.cpu0[k], 1) for k in sampler.pids},
            "peak_cpu_pct_1s": {k: round(v) for k, v in sampler.peak_cpu_pct.items()},
            "loadavg_before": [round(x, 2) for x in load0], "loadavg_rollout_start": [round(x, 2) for x in load_start],
            "loadavg_rollout_end": [round(x, 2) for x in load_end], "cpus": os.cpu_count(),
        }
        if not args.no_rollback and state.get("status") == "done":
            counter.counting = True
            t0 = time.monotonic()
            rb = subprocess.Popen(cli + ["rollback", "bench", *op_broker], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(work / "rollback.log", "w"))
            procs.append(rb)
            sampler = Sampler({**pids, "operator": rb.pid, "simulator": sim.pid})
            sampler.start()
            rb_rc = rb.wait()
            sampler.stop.set()
            rollback_s = time.monotonic() - t0
            time.sleep(1.0)
            counter.counting = False
            docs = read_rollout(port, protocol, "bench")
            back = sum(1 for t, d in docs.items() if "/device/" in t and isinstance(d, dict)
                       and (d.get("rollback") or {}).get("state") == "done")
            rbc = counter.commands["rollback"]
            res.update({
                "rollback_rc": rb_rc, "rollback_s": round(rollback_s, 1), "rolled_back": back,
                "rollback_commands": sum(rbc.values()), "rollback_commands_per_device_max": max(rbc.values(), default=0),
                "rollback_update_commands": sum(counter.commands["update"].values()) - sum(upd.values()),
                "rollback_peak_rss_mib": {k: round(v, 1) for k, v in sampler.peak.items()},
                "rollback_cpu_s": {k: round(sampler.cpu1[k] - sampler.cpu0[k], 1) for k in sampler.pids},
                "loadavg_rollback_end": [round(x, 2) for x in os.getloadavg()],
            })
        counter.c.loop_stop()
        counter.c.disconnect()
        if args.broker_kind == "mosquitto":  # the physical limit for the same messages: one publisher, one subscriber
            raw_s, raw_how = raw_rate(port, int(received), avg_size)
            res.update({"raw_broker_s_same_count": round(raw_s, 2), "raw_broker_path": raw_how,
                        "raw_broker_msgs_per_s": round(received / raw_s) if raw_s else None,
                        "ratio_raw_to_rollout_time": round(raw_s / rollout_s, 4)})
        sim.terminate()
        print("| figure | value |\n|---|---|")
        for k, v in res.items():
            print(f"| {k} | {v} |")
        if args.json:
            args.json.write_text(json.dumps(res, indent=1) + "\n")
        return 0 if state.get("status") == "done" else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        if args.json:  # the operator's and the simulator's logs, beside the figures
            for log in ("operator.log", "rollback.log", "sim.log"):
                if (work / log).exists():
                    shutil.copy(work / log, args.json.with_suffix("." + log))
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
