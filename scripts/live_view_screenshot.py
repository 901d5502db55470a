"""Regenerate docs/live-view.png: the demo served with `metrics.live_view`, its /live page in headless Chromium.

    python scripts/live_view_screenshot.py [--out docs/live-view.png]

Starts `edge-agent run` on the demo frames (a temporary state dir, a free port on 127.0.0.1), waits for the
page to show a drawn frame, takes the screenshot, stops the agent. The same page is checked in CI by
tests/test_live_view.py.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "live-view.png")
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="edge-agent-live-") as tmp:
        cfg = Path(tmp) / "agent.yaml"
        cfg.write_text(yaml.safe_dump({
            "device_id": "demo", "state_dir": str(Path(tmp) / "state"), "bundle": str(ROOT / "models" / "digits-classifier"),
            "source": {"type": "folder", "path": str(ROOT / "models" / "demo-frames" / "digits"), "loop": True,
                       "max_fps": 5, "name": "demo-frames"},
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
                            f"--user-data-dir={Path(tmp) / 'chromium'}", "--no-first-run", "--window-size=1000,480",
                            f"--screenshot={args.out.resolve()}", page], check=True, capture_output=True, timeout=120)
        finally:
            agent.terminate()
            agent.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
