"""Serving benchmark: one run, one table, the demo classifier, the same variant and thread settings.

  1. raw `InferenceSession.run` in a loop on already-preprocessed tensors (the limit)
  2. the naive sequential loop a user would write: cv2 read -> preprocess -> run -> decode -> print
  3. `edge-agent run` on the same video file (decode included), as a separate process

Reports fps and p50/p99 latency of each, the ratios 3/1 and 3/2, and the agent's peak RSS.
Usage: python scripts/bench_serving.py [--repeat 4] [--variant auto|fp32|int8]
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from agent.bundle.load import load_bundle  # noqa: E402
from agent.config import Config  # noqa: E402
from agent.spec.decoders import decode  # noqa: E402
from agent.proof.selftest import options_from_config, run_selftest  # noqa: E402
from agent.proof.session import open_session  # noqa: E402
from agent.proof.terms import SessionSettings  # noqa: E402
from make_demo_frames import write_video  # noqa: E402

BUNDLE = ROOT / "models" / "digits-classifier"


def pct(ms: list[float]) -> tuple[float, float]:
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4, help="video length: held-out frames x repeat")
    ap.add_argument("--variant", default="auto")
    ap.add_argument("--intra", type=int, default=SessionSettings().intra_op_threads,
                    help="intra-op threads for all three (0: ORT default; default: the agent's default)")
    ap.add_argument("--spin", action="store_true", help="let ORT pool threads spin (ORT's default; off in the agent)")
    ap.add_argument("--max-batch", type=int, default=1, help="agent micro-batch size")
    ap.add_argument("--workers", type=int, default=0, help="agent inference worker threads (0: auto)")
    args = ap.parse_args()
    bundle = load_bundle(BUNDLE)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variant = args.variant
        if variant == "auto":
            report = run_selftest(bundle, tmp / "state", options_from_config(Config()))
            variant = report.selected.candidate.variant
        with np.load(ROOT / "calibration" / "digits" / "heldout.npz") as z:
            frames = z["raw"]
        video = write_video(frames, tmp / "bench.avi", repeat=args.repeat)
        n = len(frames) * args.repeat
        model = bundle.path(bundle.manifest.variant(variant).file)
        pre, spec, labels = bundle.preprocessor(), bundle.manifest.postprocess, bundle.labels()

        # 1. raw session.run on preprocessed tensors
        settings = SessionSettings(intra_op_threads=args.intra, allow_spinning=args.spin)
        sess = open_session(model, "CPUExecutionProvider", settings=settings)
        tensors = [pre(f) for f in frames]
        for t in tensors[:20]:
            sess.run(t)
        lat = []
        t0 = time.perf_counter()
        for i in range(n):
            s = time.perf_counter_ns()
            sess.run(tensors[i % len(tensors)])
            lat.append((time.perf_counter_ns() - s) / 1e6)
        raw_fps = n / (time.perf_counter() - t0)
        raw_p = pct(lat)

        # 2. naive sequential loop
        sink = io.StringIO()
        cap = cv2.VideoCapture(str(video))
        lat = []
        count = 0
        t0 = time.perf_counter()
        while True:
            s = time.perf_counter_ns()
            ok, img = cap.read()
            if not ok:
                break
            rgb = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
            out = sess.run(pre(rgb))
            result = decode(spec, {k: v[0] for k, v in out.items()}, labels)
            sink.write(json.dumps({"seq": count, "result": result}) + "\n")
            lat.append((time.perf_counter_ns() - s) / 1e6)
            count += 1
        naive_fps = count / (time.perf_counter() - t0)
        naive_p = pct(lat)
        cap.release()

        # 3. edge-agent run on the same video, pinned to the same variant
        cfg = {"state_dir": str(tmp / "state"), "bundle": str(BUNDLE), "selection": {"variant": variant},
               "session": {"intra_op_threads": args.intra, "allow_spinning": args.spin},
               "source": {"type": "video", "path": str(video)},
               "pipeline": {"queue_size": 4, "max_batch": args.max_batch, "batch_timeout_ms": 2.0,
                            "inference_workers": args.workers}}
        (tmp / "agent.yaml").write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config",
                                 str(tmp / "agent.yaml")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        stamps, totals = [], []
        for line in proc.stdout:
            r = json.loads(line)
            stamps.append(time.perf_counter())
            totals.append(r["timings"]["total_ms"])
        proc.wait()
        rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        # throughput between the first and last result: excludes the process boot and self-test
        agent_fps = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        agent_p = pct(totals)

    print(f"demo classifier, variant {variant}, {n} frames of 160x160, intra-op threads {args.intra or 'default'}, "
          f"spinning {'on' if args.spin else 'off'}, agent max_batch {args.max_batch}, workers {args.workers}\n")
    print(f"{'mode':44} {'fps':>8} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'1. raw InferenceSession.run (preprocessed)':44} {raw_fps:>8.1f} {raw_p[0]:>8.3f} {raw_p[1]:>8.3f}")
    print(f"{'2. naive loop: read->pre->run->print':44} {naive_fps:>8.1f} {naive_p[0]:>8.3f} {naive_p[1]:>8.3f}")
    print(f"{'3. edge-agent run (video, decode included)':44} {agent_fps:>8.1f} {agent_p[0]:>8.3f} {agent_p[1]:>8.3f}")
    print(f"\nratio 3/1 = {agent_fps / raw_fps:.2f}   ratio 3/2 = {agent_fps / naive_fps:.2f}   "
          f"agent results {len(stamps)}/{n}   agent peak RSS {rss_mb:.0f} MB")
    print("latency: 1 and 2 per call/iteration; 3 from capture to publish (includes queueing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
