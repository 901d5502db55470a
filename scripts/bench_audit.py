"""What the serving audit costs: `edge-agent run` on the same 720p MJPEG video with the audit off and on,
in adjacent pairs (off/on, then on/off in the next round, so a load that drifts through a pair lands
on both halves alike and the order's bias cancels), judged by the ratio within each pair.

Each run is measured in its steady state: from `--skip` of its results on (by then the audit's first
checks have run and its reference session is open: a one-off cost of opening, not of auditing) to its
last result: fps, and the agent process's CPU per result (the audit runs in that process, on its own
thread). The figure is the median of the per-pair ratios (on / off) and their spread (min-max), beside
the load average before and after each run.

The defaults (a golden canary every 60 s, a live frame through the reference FP32 every 30 s, the first
of each 5 s after serving starts) do not fire in a run of seconds: that row measures the tap alone
(one clock read per inference). The 1hz and 10hz rows (60-600 times the default rate) cost the audit's
runs, so any rate can be costed: cost per second = rate x (CPU time of one inference).

Usage: python scripts/bench_audit.py [--bundle models/digits-classifier] [--frames 3000] [--rounds 4]
           [--modes default,1hz,10hz]
       python scripts/bench_audit.py --per-check 500     (the audit's CPU per check, in process)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import ROOT, _proc_cpu_s, camera_video  # noqa: E402

# checks per second (canary + live) of each setting, for the cost per check
RATES = {"default": 1 / 60 + 1 / 30, "1hz": 2.0, "10hz": 20.0}
MODES = {
    "off": {"audit.enabled": False},
    "default": {},  # 60 s / 30 s; the first checks come 5 s after serving starts: in a short run, the tap alone
    "1hz": {"audit.canary_period_s": 1.0, "audit.live_period_s": 1.0, "audit.live_window": 2},
    "10hz": {"audit.canary_period_s": 0.1, "audit.live_period_s": 0.1},
}


@dataclass(frozen=True)
class Run:
    fps: float     # results per second over the steady-state window
    cpu_ms: float  # the agent process's CPU per result over the same window
    load: tuple[float, float]
    variant: str   # what served: every run must serve the same candidate, or the pair compares two models


def run_agent(video: Path, bundle: Path, settings: dict, n: int, skip: float, state: Path, tmp: Path) -> Run:
    """`edge-agent run` to the end of the video (lossless); fps and CPU per result from result
    `skip * n` to the last, CPU read from /proc every 50 results (reading it on every line would take
    CPU from the agent). Every run shares `state`: the cached verdict serves the same candidate each time
    (a cold proof on a loaded machine may pick INT8 in one run and FP32 in the next)."""
    cfg: dict = {"state_dir": str(state), "bundle": str(bundle), "source": {"type": "video", "path": str(video)},
                 "output": {"stdout": True}}
    for key, value in settings.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    (tmp / "agent.yaml").write_text(yaml.safe_dump(cfg))
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config",
                             str(tmp / "agent.yaml")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    start_at = max(int(n * skip), 1)
    count, t0, c0, t1, c1 = 0, 0.0, 0.0, 0.0, 0.0
    counted_from = counted_to = 0
    variant = "?"
    assert proc.stdout is not None
    for line in proc.stdout:
        count += 1
        if count == 1:
            variant = json.loads(line).get("variant", "?")
        if count == start_at:
            t0, c0, counted_from = time.perf_counter(), _proc_cpu_s(proc.pid), count
        elif count > start_at and (count % 50 == 0 or count == n):
            try:
                t1, c1, counted_to = time.perf_counter(), _proc_cpu_s(proc.pid), count
            except FileNotFoundError:
                pass
    proc.wait()
    if counted_to <= counted_from:
        raise SystemExit(f"the agent published {count} results (exit {proc.returncode}); need more than {start_at}")
    k = counted_to - counted_from
    return Run(k / (t1 - t0), (c1 - c0) / k * 1000, (load0, os.getloadavg()[0]), variant)


def per_check(bundle_dir: Path, n: int) -> None:
    """The audit's own CPU per check, in this process, with the agent's Auditor on a real engine (the
    served candidate's session, the reference FP32 session): `time.thread_time` around each canary and
    each live sample (the tap's copy, the reference run, and the fidelity judgement of every window), beside
    one serving inference. Process CPU time (ONNX Runtime's own threads included; nothing else runs in this
    process), not wall time: a loaded machine stretches the wall clock, not the work, so this figure holds
    where the fps ratio above is noise."""
    from agent.bundle.load import load_bundle
    from agent.config import Config
    from agent.proof.verdict import Candidate
    from agent.proof.terms import CPU
    from agent.service.audit import AUDIT_SOURCE, Auditor, AuditSettings, AuditTap
    from agent.serving.engine import build_engine

    bundle = load_bundle(bundle_dir)
    cfg = Config()
    v = bundle.manifest.variant("int8")
    engine = build_engine(bundle, Candidate(CPU, v.name, v.precision), cfg.session, tap=AuditTap())
    auditor = Auditor(AuditSettings(live_window=8), lambda: engine, cfg.session)
    auditor._attach(engine)
    golden = bundle.golden()
    tensor = golden[0].input
    served = engine.run(tensor, AUDIT_SOURCE)
    auditor._live(tensor, served)  # opens the reference session (once per engine: not a per-check cost)
    costs: dict[str, list[float]] = {"serving inference": [], "canary": [], "live sample": []}
    for _ in range(n):
        t0 = time.process_time()
        engine.run(tensor, AUDIT_SOURCE)
        t1 = time.process_time()
        auditor._canary()
        t2 = time.process_time()
        auditor._next_live = 0.0
        auditor._tap(engine, tensor, served)  # the copy, on the inference thread in serving
        auditor._live(*auditor._samples.get_nowait())  # every live_window-th call also judges the window
        t3 = time.process_time()
        costs["serving inference"].append(t1 - t0)
        costs["canary"].append(t2 - t1)
        costs["live sample"].append(t3 - t2)
    mean = {k: statistics.fmean(x) * 1000 for k, x in costs.items()}
    at_defaults = mean["canary"] / 60 + mean["live sample"] / 30  # ms of CPU per second of serving
    print(f"\nper check, {n} of each, process CPU time, {bundle_dir.name} int8 serving, reference fp32 "
          f"(load average {os.getloadavg()[0]:.2f}):")
    for k, ms in mean.items():
        print(f"  {k:18s} {ms:6.3f} ms (median {statistics.median(costs[k]) * 1000:.3f})")
    print(f"  at the defaults (a canary every 60 s, a live sample every 30 s): {at_defaults:.4f} ms of CPU per "
          f"second of serving = {at_defaults / 10:.5f} % of one core")
    print(f"  counters: {auditor.counters}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=ROOT / "models" / "digits-classifier")
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=4, help="pairs per mode (off/on in even rounds, on/off in odd)")
    ap.add_argument("--modes", default="default,1hz,10hz", help=f"audit settings against off: {', '.join(MODES)}")
    ap.add_argument("--skip", type=float, default=0.4, help="fraction of each run's results before the window")
    ap.add_argument("--per-check", type=int, default=0, metavar="N",
                    help="instead: the audit's CPU per check, N checks of each in this process")
    args = ap.parse_args()
    if args.per_check:
        per_check(args.bundle, args.per_check)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES or m == "off"]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {[m for m in MODES if m != 'off']}")
    raw = np.load(ROOT / "calibration" / "digits" / "heldout.npz")["raw"][:64]
    load0 = os.getloadavg()
    fps_ratio: dict[str, list[float]] = {m: [] for m in modes}
    cpu_ratio: dict[str, list[float]] = {m: [] for m in modes}
    fps: dict[str, list[float]] = {m: [] for m in ["off", *modes]}
    cpu: dict[str, list[float]] = {m: [] for m in ["off", *modes]}
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        video = camera_video(raw, 720, 1280, args.frames, "mjpeg", Path(tmp))
        state = Path(tmp) / "state"
        (Path(tmp) / "warm").mkdir()
        warm = run_agent(video, args.bundle, MODES["off"], args.frames, args.skip, state, Path(tmp) / "warm")
        print(f"warm-up (the cold proof, not counted): serves {warm.variant}", flush=True)
        for r in range(args.rounds):
            for mode in modes:
                order = ("off", mode) if r % 2 == 0 else (mode, "off")
                got: dict[str, Run] = {}
                for m in order:
                    run_dir = Path(tmp) / f"{m}-{mode}-{r}"
                    run_dir.mkdir()
                    got[m] = run_agent(video, args.bundle, MODES[m], args.frames, args.skip, state, run_dir)
                    if got[m].variant != warm.variant:
                        raise SystemExit(f"{m} served {got[m].variant}, the warm-up {warm.variant}: not comparable")
                    fps[m].append(got[m].fps)
                    cpu[m].append(got[m].cpu_ms)
                fps_ratio[mode].append(got[mode].fps / got["off"].fps)
                cpu_ratio[mode].append(got[mode].cpu_ms / got["off"].cpu_ms)
                print(f"round {r + 1} {'/'.join(order):12s} " + "  ".join(
                    f"{m} {got[m].fps:6.1f} fps {got[m].cpu_ms:5.2f} ms CPU (load {got[m].load[0]:.1f}->{got[m].load[1]:.1f})"
                    for m in order) + f"  on/off fps {fps_ratio[mode][-1]:.3f}", flush=True)
    load1 = os.getloadavg()
    print(f"\n{args.frames} frames 720p MJPEG, {args.bundle.name} ({warm.variant} serving), {args.rounds} off/on pairs per mode (order "
          f"alternating), steady state from result {int(args.frames * args.skip)}, "
          f"{len(os.sched_getaffinity(0))} cores, load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'audit':9s} {'fps on/off':>10s} {'spread':>13s} {'CPU/frame on/off':>16s} {'spread':>13s} "
          f"{'fps on':>8s} {'fps off':>8s}  (medians)")
    off_fps, off_cpu = statistics.median(fps["off"]), statistics.median(cpu["off"])
    for mode in modes:
        fr, cr = fps_ratio[mode], cpu_ratio[mode]
        print(f"{mode:9s} {statistics.median(fr):10.3f} {min(fr):6.3f}-{max(fr):<6.3f} {statistics.median(cr):16.3f} "
              f"{min(cr):6.3f}-{max(cr):<6.3f} {statistics.median(fps[mode]):8.1f} {off_fps:8.1f}")
    # the audit's CPU per second of serving: (CPU per frame on - off) x frames per second, and per check
    fast = [m for m in modes if m != "default"]
    for mode in fast:
        if min(cpu_ratio[mode]) <= 1.0:
            print(f"{mode}: the pairs' CPU-per-frame ratios reach {min(cpu_ratio[mode]):.3f}: the audit's cost is "
                  "inside this run's noise (see --per-check)")
            continue
        extra = (statistics.median(cpu[mode]) - off_cpu) * statistics.median(fps[mode])
        each = extra / RATES[mode]
        print(f"{mode}: about {extra:.0f} ms of CPU per second of serving ({extra / 10:.1f} % of a core), "
              f"{each:.1f} ms per check; at the defaults ({RATES['default'] * 60:.0f} checks a minute) that is "
              f"{each * RATES['default']:.2f} ms/s ({each * RATES['default'] / 10:.3f} % of a core)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
