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

Printed: boots, candidates charged, charges with no crash behind them (target 0), boots that served nothing
although a candidate passed its proof (target 0), and the load average. Results lost uncounted at a stop
(the outbox's business) are not measured here: this script runs without a broker.

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

DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _config(work: Path) -> Path:
    bundle = work / "bundle"
    if not bundle.exists():
        shutil.copytree(DEMO, bundle)
        rewrite_manifest(bundle, lambda m: m["preference"].update(CPUExecutionProvider=["int8", "fp32"]))
    cfg = {"device_id": "chaos", "state_dir": str(work / "state"), "bundle": str(bundle),
           "source": {"type": "folder", "path": str(FRAMES), "loop": True},
           "selection": {"prefer_margin": 1.0}, "output": {"health_interval_s": 0.5}}
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
    return {"served": log.with_suffix(".out").stat().st_size > 0, "ready": "boot.ready" in names,
            "not_serving": next((e.get("reason") for e in events if e.get("event") == "boot.not_serving"), None),
            "passed": any(e.get("event") == "boot.ready" for e in events)
            or any("skipped: this candidate crashed" in json.dumps(e) for e in events)}


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
    cfg = _config(work)
    boots = dark = 0
    kinds: dict[str, int] = {}
    for i in range(args.kills):
        how = random.choice(["SIGKILL", "SIGKILL", "SIGTERM", "stop-timeout"])
        kinds[how] = kinds.get(how, 0) + 1
        if random.random() < 1 / 3:
            r = _boot(cfg, work / f"kill-{i}.log", random.uniform(0.5, 8.0), how)
        else:
            r = _boot(cfg, work / f"kill-{i}.log", None, how, after_first=random.uniform(0.0, 0.5))
        boots += 1
        dark += bool(r["not_serving"]) and not r["served"]
        print(f"kill {i + 1}/{args.kills}: {how:12s} served={r['served']} not_serving={r['not_serving']!s:.80}",
              flush=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        for i in range(args.cold):
            r = _boot(cfg, work / f"cold-{i}.log", None, "SIGTERM")
            boots += 1
            dark += bool(r["not_serving"]) and not r["served"]
            print(f"cold {i + 1}/{args.cold}: served={r['served']} not_serving={r['not_serving']!s:.80} "
                  f"load={os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    records = json.loads((work / "state" / "selftest" / "crashes.json").read_text()) \
        if (work / "state" / "selftest" / "crashes.json").exists() else []
    print(json.dumps({"boots": boots, "kills": kinds, "candidates_charged": sorted({r["step"] for r in records}),
                      "charges_without_a_crash": len(records), "boots_dark": dark,
                      "load_average": os.getloadavg(), "work": str(work)}, indent=2))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not records and not dark else 1


if __name__ == "__main__":
    sys.exit(main())
