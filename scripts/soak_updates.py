"""Soak the update paths: a real agent and a real Mosquitto for N seconds, one hostile or ordinary command a
second (status, URL updates that trickle or 404, rollbacks, offers with wrong chunks, hostile inbox entries,
pause/resume), sampling the agent's RSS, threads and open fds. Prints a table and the drift.

    python scripts/soak_updates.py --seconds 600

Speed and size are measured here, never in timed tests. The figures go in the note of the issue.
"""

from __future__ import annotations

import argparse
import itertools
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

import paho.mqtt.client as paho
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "dev-soak"
PREFIX = f"edge/{DEVICE}/"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(work: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text("\n".join([*(["user root"] if os.geteuid() == 0 else []), f"listener {port} 127.0.0.1",
                               "allow_anonymous true", "log_dest none"]) + "\n")
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("mosquitto did not start")


def trickle_server() -> int:
    """Status line, then a header byte every 0.5 s: each URL update ends at the download deadline."""
    srv = socket.create_server(("127.0.0.1", 0))

    def one(conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            for _ in range(40):
                conn.sendall(b"a")
                time.sleep(0.5)
        except OSError:
            pass
        finally:
            conn.close()

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def sample(pid: int) -> dict[str, float]:
    st = {k: v for k, v in (line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())}
    return {"rss_mb": int(st["VmRSS"].split()[0]) / 1024, "threads": int(st["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--sample-s", type=float, default=10)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-updates-"))
    broker, port = start_broker(work)
    web = trickle_server()
    inbox = work / "inbox"
    cfg = {"device_id": DEVICE, "state_dir": str(work / "state"), "bundle": str(ROOT / "models" / "digits-classifier"),
           "source": {"type": "folder", "path": str(ROOT / "models" / "demo-frames" / "digits"), "loop": True,
                      "max_fps": 30},
           "output": {"stdout": False, "health_interval_s": 1.0},
           "mqtt": {"enabled": True, "port": port, "keepalive": 5, "reconnect_min_s": 1, "reconnect_max_s": 1},
           "updates": {"enabled": True, "inbox": str(inbox), "download_timeout_s": 1.0, "download_deadline_s": 2.0,
                       "transfer_idle_s": 5.0, "min_free_bytes": 0}}
    (work / "agent.yaml").write_text(yaml.safe_dump(cfg))
    agent = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(work / "agent.yaml")],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "w"))
    replies: list[bytes] = []
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    c.on_message = lambda cl, u, m: replies.append(m.payload)
    c.connect("127.0.0.1", port)
    c.subscribe(PREFIX + "cmd/+/reply")
    c.loop_start()
    time.sleep(15)  # boot and the first proof
    n = itertools.count()

    def command(i: int) -> None:
        kind = i % 8
        if kind == 0:
            c.publish(PREFIX + "cmd/status", json.dumps({"id": i}), qos=1)
        elif kind == 1:
            c.publish(PREFIX + "cmd/update", json.dumps({"url": f"http://127.0.0.1:{web}/b.tar.gz", "sha256": "0" * 64,
                                                         "id": f"u{i}"}), qos=1)
        elif kind == 2:
            c.publish(PREFIX + "cmd/rollback", json.dumps({"id": f"r{i}"}), qos=1)
        elif kind == 3:
            c.publish(PREFIX + "bundle/offer", json.dumps({"transfer": f"t{i}", "size": 8192, "sha256": "0" * 64,
                                                           "chunk_size": 4096}), qos=1)
            c.publish(PREFIX + f"bundle/chunk/t{i}/0", b"x" * 10, qos=1)  # wrong size: rate-limited warning
        elif kind == 4 and inbox.is_dir():
            p = inbox / f"fifo{i}.tar.gz"
            os.mkfifo(p)
        elif kind == 5 and inbox.is_dir():
            (inbox / f"dangling{i}.tar.gz").symlink_to(inbox / "nowhere")
        elif kind == 6:
            c.publish(PREFIX + "cmd/pause", b"{}", qos=1)
        else:
            c.publish(PREFIX + "cmd/resume", json.dumps({"id": float("nan")}).encode(), qos=1)  # NaN id: strict JSON

    rows: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    next_sample = t0
    try:
        while time.monotonic() - t0 < args.seconds:
            if agent.poll() is not None:
                print(f"agent exited with {agent.returncode}", file=sys.stderr)
                return 1
            command(next(n))
            if time.monotonic() >= next_sample:
                rows.append((time.monotonic() - t0, sample(agent.pid)))
                next_sample += args.sample_s
            time.sleep(1.0)
        rows.append((time.monotonic() - t0, sample(agent.pid)))
    finally:
        agent.terminate()
        agent.wait(timeout=60)
        broker.terminate()
        c.loop_stop()
    print("| t (s) | RSS (MB) | threads | fds |\n|---|---|---|---|")
    for t, r in rows[:: max(1, len(rows) // 12)] + [rows[-1]]:
        print(f"| {t:.0f} | {r['rss_mb']:.1f} | {r['threads']:.0f} | {r['fds']:.0f} |")
    warm = [r for t, r in rows if t >= 60] or [r for _, r in rows]
    for key in ("rss_mb", "threads", "fds"):
        vals = [r[key] for r in warm]
        print(f"{key}: after warm-up min {min(vals):.1f} max {max(vals):.1f} first {vals[0]:.1f} last {vals[-1]:.1f}")
    bad = [p for p in replies if b"NaN" in p.split(b'"error"')[0] or b"Infinity" in p.split(b'"error"')[0]]
    print(f"commands: {next(n)}, replies: {len(replies)}, replies with NaN/Infinity outside an error text: {len(bad)}")
    print(f"load average: {os.getloadavg()}")
    print(f"work dir: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
