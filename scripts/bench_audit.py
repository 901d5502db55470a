"""What the serving audit costs: `edge-agent run` on the same 720p MJPEG video with the audit off, at its
defaults, and at an aggressive rate, in interleaved rounds (one run of each per round, so a burst of load
lands on all alike), fps from first to last result, the agent's CPU per frame, the load average.

The defaults (a golden canary every 60 s, a live frame through the reference FP32 every 30 s, the first
of each 5 s after serving starts) do not fire in a run of seconds: that row measures the tap alone. The
1hz row (30-60 times the default rate) and the aggressive row (10 per second each) show the cost of the
audit's runs, so that any rate can be costed: cost per second = rate x (CPU time of one inference), plus
opening the reference session once.

Usage: python scripts/bench_audit.py [--bundle models/digits-classifier] [--frames 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import ROOT, agent, camera_video  # noqa: E402

MODES = {
    "off": {"audit.enabled": False},
    "default": {},  # 60 s / 30 s; the first checks come 5 s after serving starts: in a short run, the tap alone
    "1hz": {"audit.canary_period_s": 1.0, "audit.live_period_s": 1.0, "audit.live_window": 2},
    "aggressive": {"audit.canary_period_s": 0.1, "audit.live_period_s": 0.1},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=ROOT / "models" / "digits-classifier")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    raw = np.load(ROOT / "calibration" / "digits" / "heldout.npz")["raw"][:64]
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        video = camera_video(raw, 720, 1280, args.frames, "mjpeg", Path(tmp))
        fps: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode, settings in MODES.items():
                run_dir = Path(tmp) / f"{mode}-{r}"
                run_dir.mkdir()
                res = agent(video, args.bundle, "auto", {"output.stdout": True, **settings}, args.frames, run_dir)
                fps[mode].append(res.fps)
                cpu[mode].append(res.cpu_ms)
                print(f"round {r + 1} {mode:10s} {res.fps:7.1f} fps  {res.cpu_ms:6.2f} ms CPU/frame", flush=True)
    load1 = os.getloadavg()
    base = statistics.median(fps["off"])
    print(f"\n{args.frames} frames 720p MJPEG, {args.bundle.name}, {args.rounds} interleaved rounds, "
          f"{len(os.sched_getaffinity(0))} cores, load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'audit':12s} {'fps (median)':>12s} {'spread':>16s} {'CPU ms/frame':>13s} {'fps / off':>10s}")
    for mode in MODES:
        med = statistics.median(fps[mode])
        print(f"{mode:12s} {med:12.1f} {min(fps[mode]):7.1f}-{max(fps[mode]):<8.1f} "
              f"{statistics.median(cpu[mode]):13.2f} {med / base:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
