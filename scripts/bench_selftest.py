"""Benchmark: boot-to-verdict time (cold and warm) and per-candidate latency against raw ORT.

Cold: a fresh state directory, so every candidate is probed, checked and timed.
Warm: the cached verdict, so only the winner's short parity check runs.
Each boot is a real `python -m agent selftest` process, timed from spawn to exit.
The per-candidate latency from the self-test is compared with a plain `InferenceSession.run` loop
on the same model file and the same thread settings, measured in this same run.

Usage: python scripts/bench_selftest.py [--bundle models/digits-classifier] [--boots 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.bundle.load import load_bundle  # noqa: E402
from agent.proof.session import measure_latency, session_options  # noqa: E402
from agent.proof.terms import SessionSettings  # noqa: E402


def boot(bundle: Path, state: Path, *extra: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle", str(bundle),
                          "--state-dir", str(state), "--json", *extra], capture_output=True, text=True, check=True)
    return (time.perf_counter() - t0) * 1000, json.loads(out.stdout)


def raw_latency(model: Path, tensor: np.ndarray, runs: int) -> tuple[float, float]:
    """A plain session with the agent's own default thread settings, so the ratio is like for like."""
    sess = ort.InferenceSession(str(model), session_options(SessionSettings(), record_assignment=False),
                                providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    stats = measure_latency(lambda t: sess.run(None, {name: t}), tensor, warmup=10, runs=runs)
    return stats.p50_ms, stats.p95_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=ROOT / "models" / "digits-classifier")
    ap.add_argument("--boots", type=int, default=5)
    ap.add_argument("--runs", type=int, default=300)
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)

    cold, warm, cold_in, warm_in = [], [], [], []
    doc: dict = {}
    for _ in range(args.boots):
        with tempfile.TemporaryDirectory() as tmp:
            ms, doc = boot(args.bundle, Path(tmp))
            cold.append(ms)
            cold_in.append(doc["duration_ms"])
            ms, wdoc = boot(args.bundle, Path(tmp))
            assert wdoc["cached"], "second boot did not reuse the cached verdict"
            warm.append(ms)
            warm_in.append(wdoc["duration_ms"])

    print(f"bundle {bundle.identity}, onnxruntime {ort.__version__}, {args.boots} boots each\n")
    print(f"{'boot':6} {'process spawn->exit ms':>24} {'self-test in-process ms':>25}")
    print(f"{'cold':6} {statistics.median(cold):>24.0f} {statistics.median(cold_in):>25.0f}")
    print(f"{'warm':6} {statistics.median(warm):>24.0f} {statistics.median(warm_in):>25.0f}")
    print(f"warm/cold in-process: {statistics.median(warm_in) / statistics.median(cold_in):.2f}\n")

    tensor = bundle.golden()[0].input
    print(f"{'candidate':22} {'selftest p50':>12} {'raw ORT p50':>12} {'ratio':>6} {'selftest p95':>12} {'raw p95':>8}  verdict")
    for c in doc["candidates"]:
        if not c.get("latency"):
            continue
        rp50, rp95 = raw_latency(bundle.path(bundle.manifest.variant(c["variant"]).file), tensor, args.runs)
        lat = c["latency"]
        short = c["provider"].replace("ExecutionProvider", "")
        print(f"{short + ':' + c['variant']:22} {lat['p50_ms']:>12.3f} {rp50:>12.3f} {lat['p50_ms'] / rp50:>6.2f} "
              f"{lat['p95_ms']:>12.3f} {rp95:>8.3f}  {'PASS' if c['passed'] else 'FAIL'}")
    sel = doc["selected"]
    print(f"\nselected: {sel['provider']}:{sel['variant']}" if sel else f"\nselected nothing: {doc['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
