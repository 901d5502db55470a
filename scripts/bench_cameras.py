"""More cameras, never fewer results (issue 48): 1, 2, 4, 8 1080p H.264 RTSP cameras into one detector agent.

Each row is `edge-agent run` with k RTSP cameras (tests/fixtures/rtsp_server.py, each its own video of the layout
model's held-out pages, at --camera-fps) serving the YOLO-320 detector (built from the layout model's package by
scripts/yolo_resize.py), stopped once every camera has --frames results. With the detector at its CPU limit, a
frame that waits while its camera sends a newer one is dropped before it is converted (latest-frame-wins per
camera, each camera keeping its turn), so results per second in all should not fall as cameras are added.

Printed per row: results/s in all (the sum of each camera's rate from its first to its last result), each camera's
rate (min..max), capture-to-publish p50/p95, peak and serving RSS against one camera, the agent's CPU per result,
the load average before and after; then the targets: results/s never lower with more cameras; p95 at one camera
<= 1.5x one inference's wall time (the served session's settings, measured here on the same frames); RSS at four
cameras <= 1.3x one.

Usage: PYTHONPATH=. python scripts/bench_cameras.py [--cameras 1,2,4,8] [--camera-fps 15] [--frames 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serving import CORES, RtspCamera, _variant_and_frames, camera_videos, multi_agent, yolo_bundle  # noqa: E402

from agent.bundle.load import load_bundle  # noqa: E402
from agent.proof.session import open_session  # noqa: E402
from agent.proof.terms import SessionSettings  # noqa: E402


def inference_wall_ms(bundle, variant: str, raw: np.ndarray, runs: int = 50) -> float:
    """One inference's wall time with the served session's settings (the shipped SessionSettings), median."""
    model = bundle.path(bundle.manifest.variant(variant).file)
    sess = open_session(model, "CPUExecutionProvider", settings=SessionSettings())
    tensor, _ = bundle.preprocessor().with_geometry(raw[0])
    for _ in range(5):
        sess.run(tensor)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(tensor)
        times.append((time.perf_counter() - t0) * 1000)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cameras", default="1,2,4,8", help="camera counts, one agent run each, in this order")
    ap.add_argument("--camera-fps", type=float, default=15.0, help="each camera's frame rate")
    ap.add_argument("--frames", type=int, default=60, help="results per camera before a run stops")
    ap.add_argument("--variant", default="auto", help="auto: the self-test's choice, then pinned for the agent")
    args = ap.parse_args()
    counts = [int(k) for k in args.cameras.split(",")]
    bundle_dir, frames_from = yolo_bundle()
    bundle = load_bundle(bundle_dir)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        variant, raw = _variant_and_frames(bundle, args.variant, tmp, frames_from)
        one_ms = inference_wall_ms(bundle, variant, raw)
        videos = camera_videos(raw, 1080, 1920, 300, max(counts), tmp, "h264")
        cameras = [RtspCamera(v, v.parent, args.camera_fps) for v in videos]
        settings = {"selection.variant": variant}
        rows = []
        try:
            for k in counts:
                # one state directory: the first run proves the bundle, the others start from its cached verdict
                rows.append(multi_agent([c.url for c in cameras[:k]], bundle_dir, settings, args.camera_fps, tmp,
                                        args.frames))
        finally:
            for c in cameras:
                c.close()
    print(f"model {bundle.manifest.name} (variant {variant}), 1080p H.264 RTSP cameras at {args.camera_fps:g} fps "
          f"each, {args.frames} results per camera, {CORES} cores; one inference {one_ms:.1f} ms wall (median of 50, "
          "the served session's settings); agent settings changed from the shipped defaults: --log-level warning, "
          f"selection.variant={variant} (the self-test's pick, pinned)")
    print(f"{'cameras':>7} {'results/s':>9} {'per camera (min..max)':>21} {'p50 / p95 ms':>15} {'peak RSS':>8} "
          f"{'vs 1':>5} {'serving':>7} {'vs 1':>5} {'CPU ms/result':>13} {'load':>11}")
    first = rows[0]
    for r in rows:
        f = list(r.fps.values())
        print(f"{r.sources:>7} {sum(f):>9.1f} {f'{min(f):.1f}..{max(f):.1f}':>21} "
              f"{f'{r.p50_ms:.0f} / {r.p95_ms:.0f}':>15} {r.rss_mb:>8.0f} {r.rss_mb / first.rss_mb:>5.2f} "
              f"{r.serving_rss_mb:>7.0f} {r.serving_rss_mb / first.serving_rss_mb:>5.2f} {r.cpu_ms:>13.1f} "
              f"{f'{r.load[0]}/{r.load[1]}':>11}")
    totals = [sum(r.fps.values()) for r in rows]
    falls = [(a.sources, b.sources) for a, b, x, y in zip(rows, rows[1:], totals, totals[1:]) if y < 0.95 * x]
    print("targets: results/s never lower with more cameras (a fall of more than 5 %, the runs' spread, counts): "
          + ("met" if not falls else f"NOT met ({', '.join(f'{a} -> {b}' for a, b in falls)})"))
    if first.sources == 1:
        print(f"p95 capture->publish at one camera {first.p95_ms:.0f} ms <= 1.5 x {one_ms:.1f} = {1.5 * one_ms:.0f} ms: "
              + ("met" if first.p95_ms <= 1.5 * one_ms else "NOT met"))
        four = next((r for r in rows if r.sources == 4), None)
        if four is not None:
            ratio = four.rss_mb / first.rss_mb
            print(f"peak RSS at four cameras {ratio:.2f} x one <= 1.3: {'met' if ratio <= 1.3 else 'NOT met'} "
                  f"(serving {four.serving_rss_mb / first.serving_rss_mb:.2f})")
    print(f"load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
