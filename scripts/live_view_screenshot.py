"""Regenerate docs/live-view.png and docs/live-view-detector.png: the /live page in headless Chromium.

    python scripts/live_view_screenshot.py [--only demo|detector] [--out-dir docs]

live-view.png: the demo bundle on the demo frames. live-view-detector.png: a real detector, the RetinaFace
MobileNet-0.25 face bundle with its 5 landmarks (built by scripts/real_models.py into the cache's real-bundles/,
`retinaface-bundle-*`), on the first frame of its held-out set (real-models/retinaface/heldout/0000.png, two
faces). Each: `edge-agent run` on the frames looping (a temporary state dir, a free port on 127.0.0.1), the page
until it shows a drawn frame, the screenshot, the agent stopped. The same page is checked in CI by
tests/link/test_live_view.py (the demo and a stand-in detector).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("demo", "detector"), default=None, help="one picture (default: both)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs")
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    rc = 0
    if args.only in (None, "demo"):
        rc |= shoot(chromium, args.out_dir / "live-view.png", "demo", ROOT / "models" / "digits-classifier",
                    ROOT / "models" / "demo-frames" / "digits", "demo-frames", (1000, 480))
    if args.only in (None, "detector"):
        bundles = sorted((CACHE / "real-bundles").glob("retinaface-bundle-*"))
        frame = CACHE / "real-models" / "retinaface" / "heldout" / "0000.png"
        if not bundles or not frame.exists():
            print(f"no RetinaFace bundle or held-out frame in {CACHE} (python scripts/real_models.py fetch retinaface, "
                  "then its references and bundle): live-view-detector.png not made", file=sys.stderr)
            return 1
        with tempfile.TemporaryDirectory(prefix="edge-agent-frames-") as frames:
            shutil.copy(frame, Path(frames) / frame.name)
            rc |= shoot(chromium, args.out_dir / "live-view-detector.png", "faces", bundles[-1], Path(frames),
                        "door-camera", (1100, 600))
    return rc


def shoot(chromium: str, out: Path, device_id: str, bundle: Path, frames: Path, name: str,
          window: tuple[int, int]) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="edge-agent-live-") as tmp:
        cfg = Path(tmp) / "agent.yaml"
        cfg.write_text(yaml.safe_dump({
            "device_id": device_id, "state_dir": str(Path(tmp) / "state"), "bundle": str(bundle),
            "source": {"type": "folder", "path": str(frames), "loop": True, "max_fps": 5, "name": name},
            "output": {"stdout": False}, "metrics": {"listen": f"127.0.0.1:{port}", "live_view": True}}))
        agent = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config", str(cfg)],
                                 cwd=ROOT)
        try:
            page = f"http://127.0.0.1:{port}/live"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(page, timeout=5) as r:  # each look keeps the view watched
                        if b"<img id='live-0'" in r.read():
                            break
                except OSError:
                    pass
                time.sleep(0.5)
            else:
                print("the live page showed no frame within 180 s", file=sys.stderr)
                return 1
            time.sleep(1.5)  # a drawn snapshot of a served frame
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--user-data-dir={Path(tmp) / 'chromium'}", "--no-first-run", f"--window-size={window[0]},{window[1]}",
                            f"--screenshot={out.resolve()}", page], check=True, capture_output=True, timeout=120)
        finally:
            agent.terminate()
            agent.wait(timeout=30)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
