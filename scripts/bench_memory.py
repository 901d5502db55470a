"""Where a detector agent's memory goes (issue 48): one 1080p H.264 RTSP camera into the YOLO-320 detector.

Two measurements, one run:
- **stages**, in a fresh process that builds what `edge-agent run` builds, one part at a time, with the agent's
  own code (imports, the bundle, the serving session, its first inferences, the camera's source and decoder,
  frames decoded and preprocessed as the pipeline does): RSS after each part, split into anonymous memory
  (heaps, arenas, buffers) and file-backed pages (shared libraries, the model file mapped), and the part's share;
- **the agent** itself serving that camera at its frame rate: its peak and serving RSS, the same split, and what
  the stages do not explain (the pipeline's threads and queues, the audit, the outbox, health) as the remainder.

Usage: PYTHONPATH=. python scripts/bench_memory.py [--fps 10] [--results 100]
Prints the table with the load average; nothing is changed from the shipped defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_mb(pid: int | str = "self") -> dict[str, float]:
    """A process's RSS, its anonymous and file-backed parts, and its peak, in MB (from /proc/<pid>/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def stages(bundle_dir: str, url: str, frames: int) -> None:
    """The child: each part as `edge-agent run` makes it, RSS printed (one JSON line) after each."""
    rows: list[dict] = []

    def mark(part: str) -> None:
        rows.append({"part": part, **_status_mb()})

    mark("interpreter")
    import numpy  # noqa: F401
    mark("numpy")
    import cv2  # noqa: F401
    mark("opencv")
    import onnxruntime  # noqa: F401
    mark("onnxruntime")
    import av  # noqa: F401
    mark("PyAV (FFmpeg)")
    import threading

    from agent.service import cli  # noqa: F401  (what `edge-agent run` imports: every agent module it needs)
    from agent.bundle.load import load_bundle
    from agent.config import Config, SourceConfig
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.serving.sources import open_source
    mark("agent modules")
    bundle = load_bundle(bundle_dir)
    mark("bundle loaded (manifest, golden set checked)")
    cfg = Config()
    engine = build_engine(bundle, Candidate("CPUExecutionProvider", "fp32", "fp32", {}), cfg.session)
    mark("serving session opened")
    src = open_source(SourceConfig(type="stream", url=url), bundle.manifest.frame, bundle.manifest.preprocess.resize)
    stop = threading.Event()
    first = src.read(stop)
    mark("camera opened, first frame decoded")
    tensor, _ = engine.preprocessor.with_geometry(first.data)
    for _ in range(10):
        engine.run(tensor, source="cam")
    mark("10 inferences (ORT's arena)")
    for _ in range(frames):
        f = src.read(stop)
        if f is None:
            break
        tensor, _ = engine.preprocessor.with_geometry(f.data)
        engine.run(tensor, source="cam")
    mark(f"{frames} more frames decoded, preprocessed and run")
    src.close()
    print(json.dumps(rows), flush=True)


def agent_serving(bundle_dir: Path, url: str, results: int, tmp: Path) -> dict[str, float]:
    """`edge-agent run` on the camera: its status after `results` results (peak, serving, the split)."""
    import yaml

    state = tmp / "state"
    cfg = {"state_dir": str(state), "bundle": str(bundle_dir), "source": {"type": "stream", "url": url}}
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    got, status = 0, {}
    for _ in proc.stdout:
        got += 1
        if got >= results:
            status = _status_mb(proc.pid)
            break
    proc.terminate()
    proc.wait(timeout=30)
    if not status:
        raise SystemExit(f"the agent published {got} results (exit {proc.returncode})")
    report = json.loads((state / "selftest" / "report.json").read_text())
    status["child_peak"] = max(float(c.get("peak_rss_mb", 0)) for c in report.get("costs", []))
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fps", type=float, default=10.0, help="the camera's frame rate")
    ap.add_argument("--results", type=int, default=100, help="results before the agent's RSS is read")
    ap.add_argument("--stages", nargs=3, metavar=("BUNDLE", "URL", "FRAMES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stages:
        stages(args.stages[0], args.stages[1], int(args.stages[2]))
        return 0
    sys.path.insert(0, str(ROOT / "scripts"))
    import numpy as np
    from bench_serving import RtspCamera, camera_video, yolo_bundle

    bundle_dir, frames_from = yolo_bundle()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with np.load(frames_from) as z:
            video = camera_video(z["raw"], 1080, 1920, 300, "h264", tmp)
        cam = RtspCamera(video, tmp, args.fps)
        try:
            out = subprocess.run([sys.executable, __file__, "--stages", str(bundle_dir), cam.url, "50"],
                                 capture_output=True, text=True, cwd=ROOT, check=True)
            rows = json.loads(out.stdout.strip().splitlines()[-1])
            agent = agent_serving(bundle_dir, cam.url, args.results, tmp)
        finally:
            cam.close()
    print(f"bundle: {bundle_dir} (FP32), one 1080p H.264 RTSP camera at {args.fps:g} fps; shipped defaults; "
          f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'part':48} {'RSS MB':>7} {'+MB':>6} {'anon MB':>8} {'+anon':>6} {'file MB':>8} {'+file':>6}")
    prev = None
    for r in rows:
        d = (r["VmRSS"] - prev["VmRSS"], r["RssAnon"] - prev["RssAnon"], r["RssFile"] - prev["RssFile"]) \
            if prev else (r["VmRSS"], r["RssAnon"], r["RssFile"])
        print(f"{r['part']:48} {r['VmRSS']:>7.1f} {d[0]:>+6.1f} {r['RssAnon']:>8.1f} {d[1]:>+6.1f} "
              f"{r['RssFile']:>8.1f} {d[2]:>+6.1f}")
        prev = r
    assert prev is not None
    rest = (agent["VmRSS"] - prev["VmRSS"], agent["RssAnon"] - prev["RssAnon"], agent["RssFile"] - prev["RssFile"])
    print(f"{'the agent serving, after ' + str(args.results) + ' results':48} {agent['VmRSS']:>7.1f} "
          f"{rest[0]:>+6.1f} {agent['RssAnon']:>8.1f} {rest[1]:>+6.1f} {agent['RssFile']:>8.1f} {rest[2]:>+6.1f}")
    print(f"the agent's peak (VmHWM, boot included): {agent['VmHWM']:.1f} MB; its proof child's peak: "
          f"{agent['child_peak']:.1f} MB ({agent['child_peak'] / agent['VmRSS']:.2f}x serving)")
    print("+MB: this part's share (the last row: what the stages do not build -- the pipeline's threads and "
          "queues, the audit, the outbox, health, the self-test's hand-over)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
