"""Random kills from outside, and what the crash ledger makes of them (a benchmark, not a timed test).

Each round boots `edge-agent run` on the demo bundle (a copy that prefers INT8, so both candidates are in
play; frames unpaced, so an inference is nearly always in flight) on one state directory and ends it at a
random point: a third of the rounds 0.5-8 s after the start (the boot proof, or serving), the others 0-0.5 s
after the first result (inside the first 64 inferences, where a kill used to be charged). It ends the way the
world does: SIGKILL (an operator's kill -9, the OOM killer: no fatal signal of its own), SIGTERM (a stop), or
SIGKILL after SIGTERM (a stop time-out).
No fault is injected: nothing any candidate ran crashed, so every charge in `crashes.json` is a charge with
no crash behind it. Then `--cold` boots run to their first result (or verdict) with `--load` busy processes
(default: 10x the cores) beside them.

Every boot publishes to a real Mosquitto on 127.0.0.1 (tests/brokers.py) through its outbox, and prints its
results on stdout. A subscriber collects every (boot, seq) delivered; a last boot, left alone, drains what
earlier boots kept on disk. Results lost uncounted = results produced (stdout) that never reached the
subscriber, less what the agent counted as lost (health `outbox.dropped`, which includes the losses of a stop
`lost_at_stop` and what a killed process held only in memory, `lost_at_previous_kill`): each such result
vanished with nobody told.

Printed: a table of boots, candidates charged, charges with no crash behind them (target 0), boots that served
nothing although a candidate passed its proof (target 0), results lost uncounted (target 0), with the load
average during the kills and during the cold boots.

Usage: python scripts/chaos_kills.py [--kills 30] [--cold 30] [--load N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.testing import rewrite_manifest  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from agentproc import parse_events as _events  # noqa: E402  (the suite's reader of JSON-line logs)
from brokers import Broker, Collector  # noqa: E402  (a real Mosquitto and subscriber)

DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _config(work: Path, port: int | None = None) -> Path:
    bundle = work / "bundle"
    if not bundle.exists():
        shutil.copytree(DEMO, bundle)
        rewrite_manifest(bundle, lambda m: m["preference"].update(CPUExecutionProvider=["int8", "fp32"]))
    cfg = {"device_id": "chaos", "state_dir": str(work / "state"), "bundle": str(bundle),
           "source": {"type": "folder", "path": str(FRAMES), "loop": True},
           "selection": {"prefer_margin": 1.0}, "output": {"health_interval_s": 0.5, "stdout": True}}
    if port is not None:
        cfg["mqtt"] = {"enabled": True, "host": "127.0.0.1", "port": port}
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _boot(cfg: Path, log: Path, until: float | None, how: str, after_first: float | None = None) -> dict[str, Any]:
    """One agent start; ended after `until` s by `how` (None: at its first result or its verdict, and then
    `after_first` s later when given)."""
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)],
                                cwd=ROOT, stdout=out, stderr=err)
        t0 = time.monotonic()
        while proc.poll() is None:
            time.sleep(0.05)
            text = log.read_text()
            if until is not None and time.monotonic() - t0 >= until:
                break
            if until is None and (log.with_suffix(".out").stat().st_size > 0 or '"boot.not_serving"' in text):
                break
            if time.monotonic() - t0 > 600:
                break
        if after_first is not None and proc.poll() is None:
            time.sleep(after_first)
        if proc.poll() is None:
            if how == "SIGTERM":
                proc.send_signal(signal.SIGTERM)
            elif how == "stop-timeout":
                proc.send_signal(signal.SIGTERM)
                time.sleep(random.uniform(0.0, 0.5))
                if proc.poll() is None:
                    proc.kill()
            else:
                proc.kill()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    events = _events(log.read_text())
    names = [e.get("event") for e in events]
    return {"pid": proc.pid, "served": log.with_suffix(".out").stat().st_size > 0, "ready": "boot.ready" in names,
            "not_serving": next((e.get("reason") for e in events if e.get("event") == "boot.not_serving"), None),
            "passed": any(e.get("event") == "boot.ready" for e in events)
            or any("skipped: this candidate crashed" in json.dumps(e) for e in events)}


def _results(path: Path) -> set[tuple[int, int]]:
    """(boot, seq) of each result a boot printed on stdout."""
    out = set()
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except ValueError:
                continue  # the line a kill cut short
            if "seq" in r and "boot" in r:
                out.add((int(r["boot"]), int(r["seq"])))
    return out


def _delivered(col: Collector) -> set[tuple[int, int]]:
    out = set()
    for m in list(col.messages):
        if not m.topic.endswith("/predictions"):
            continue
        doc = json.loads(m.payload)
        for r in doc if isinstance(doc, list) else [doc]:
            out.add((int(r["boot"]), int(r["seq"])))
    return out


def _last_health(col: Collector) -> dict[str, Any]:
    found = [m for m in list(col.messages) if m.topic.endswith("/health")]
    return json.loads(found[-1].payload) if found else {}


def _drain(cfg: Path, log: Path, col: Collector, timeout: float = 300) -> dict[str, Any]:
    """A last boot, left alone until its outbox is empty (what earlier boots kept on disk delivered), then stopped:
    its health's outbox figures."""
    with open(log, "w") as err, open(log.with_suffix(".out"), "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)],
                                cwd=ROOT, stdout=out, stderr=err)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            time.sleep(0.5)
            h = _last_health(col)
            box = h.get("outbox") or {}
            if h.get("serving") and "depth" in box and box["depth"] <= 1 and not box.get("on_disk"):
                break
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    time.sleep(2.0)  # the shutdown's last health and acknowledged results reach the subscriber
    return _last_health(col)


def _uncounted_by_boot(work: Path, pids: dict[int, Path], missing: set[tuple[int, int]]) -> int:
    """Results lost uncounted, boot by boot: a process's missing results against what was counted for that
    process (its own `outbox.lost_at_stop`, and the `outbox.lost_at_previous_kill` a later boot logged naming
    its pid). Summed without letting one boot's over-count (results in flight at a kill that arrived after
    all) hide another's miss."""
    counted: dict[int, int] = {}
    for log in work.glob("*.log"):
        for e in _events(log.read_text(errors="replace")):
            if e.get("event") == "outbox.lost_at_previous_kill":
                counted[int(e.get("pid") or 0)] = counted.get(int(e.get("pid") or 0), 0) + int(e["count"])
    total = 0
    for pid, log in pids.items():
        boots = {b for b, _ in _results(log.with_suffix(".out"))}
        own = sum(int(e["count"]) for e in _events(log.read_text(errors="replace"))
                  if e.get("event") == "outbox.lost_at_stop")
        lost = sum(1 for b, _ in missing if b in boots)
        total += max(0, lost - own - counted.get(pid, 0))
    return total


def _table(rows: list[tuple[str, Any, str]]) -> str:
    lines = ["| measure | value | target |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {target} |" for name, value, target in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--cold", type=int, default=30)
    p.add_argument("--load", type=int, default=10 * (os.cpu_count() or 1), help="busy processes beside cold boots")
    p.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=43)
    args = p.parse_args()
    random.seed(args.seed)
    work = args.keep or Path(tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    broker = Broker(work / "broker").start()
    col = Collector(broker.port, ["edge/chaos/predictions", "edge/chaos/health"])
    cfg = _config(work, broker.port)
    boots = dark = 0
    kinds: dict[str, int] = {}
    loads: dict[str, list[float]] = {"kills": [], "cold": []}
    pids: dict[int, Path] = {}  # each boot's process and its log
    try:
        for i in range(args.kills):
            how = random.choice(["SIGKILL", "SIGKILL", "SIGTERM", "stop-timeout"])
            kinds[how] = kinds.get(how, 0) + 1
            if random.random() < 1 / 3:
                r = _boot(cfg, work / f"kill-{i}.log", random.uniform(0.5, 8.0), how)
            else:
                r = _boot(cfg, work / f"kill-{i}.log", None, how, after_first=random.uniform(0.0, 0.5))
            pids[r["pid"]] = work / f"kill-{i}.log"
            boots += 1
            dark += bool(r["not_serving"]) and not r["served"]
            loads["kills"].append(os.getloadavg()[0])
            print(f"kill {i + 1}/{args.kills}: {how:12s} served={r['served']} not_serving={r['not_serving']!s:.80}",
                  flush=True)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        try:
            for i in range(args.cold):
                r = _boot(cfg, work / f"cold-{i}.log", None, "SIGTERM")
                pids[r["pid"]] = work / f"cold-{i}.log"
                boots += 1
                dark += bool(r["not_serving"]) and not r["served"]
                loads["cold"].append(os.getloadavg()[0])
                print(f"cold {i + 1}/{args.cold}: served={r['served']} not_serving={r['not_serving']!s:.80} "
                      f"load={os.getloadavg()[0]:.1f}", flush=True)
        finally:
            for b in burners:
                b.kill()
                b.wait()
        health = _drain(cfg, work / "drain.log", col)
        boots += 1
        produced = set().union(*(_results(o) for o in work.glob("*.out")))
        delivered = _delivered(col)
    finally:
        col.c.disconnect()
        col.c.loop_stop()
        broker.stop()
    records = json.loads((work / "state" / "selftest" / "crashes.json").read_text()) \
        if (work / "state" / "selftest" / "crashes.json").exists() else []
    counted = int((health.get("outbox") or {}).get("dropped") or 0)
    missing = produced - delivered
    uncounted = max(0, len(missing) - counted)
    by_boot_uncounted = _uncounted_by_boot(work, pids, missing)
    span = lambda xs: f"{min(xs):.1f}-{max(xs):.1f}" if xs else "-"  # noqa: E731
    print(_table([
        ("boots (kills + cold + the drain)", f"{boots} ({args.kills} + {args.cold} + 1)", ""),
        ("kills", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), ""),
        ("candidates charged", ", ".join(sorted({r["step"] for r in records})) or "none", "none"),
        ("charges with no crash behind them", len(records), "0"),
        ("boots that served nothing although a candidate passed", dark, "0"),
        ("results produced / delivered / counted lost", f"{len(produced)} / {len(produced & delivered)} / {counted}",
         ""),
        ("results lost uncounted", uncounted, "0"),
        ("results lost uncounted, boot by boot", by_boot_uncounted, "0"),
        # a result sent once and never acknowledged before a kill is counted lost and may still have arrived
        ("counted lost but delivered (sent, unacknowledged at a kill)", max(0, counted - len(missing)), ""),
        (f"load average (1 min) during kills / cold boots ({args.load} busy processes, {os.cpu_count()} cores)",
         f"{span(loads['kills'])} / {span(loads['cold'])}", ""),
    ]))
    by_boot: dict[int, int] = {}
    for b, _ in missing:
        by_boot[b] = by_boot.get(b, 0) + 1
    print(json.dumps({"missing_by_boot": by_boot, "work": str(work)}))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not records and not dark and not uncounted and not by_boot_uncounted else 1


if __name__ == "__main__":
    sys.exit(main())
