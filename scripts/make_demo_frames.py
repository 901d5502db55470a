"""Write the demo frames `edge-agent run` serves without a config: held-out digits as PNG files.

Also writes a video of the same frames when --video is given (for the serving benchmark).
Reads calibration/digits/heldout.npz (made by build_demo_classifier.py); needs no build tools.
Usage: python scripts/make_demo_frames.py [--count 48] [--video out.mp4 --repeat N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LABELS = (ROOT / "calibration" / "digits" / "labels.txt").read_text().split()


def write_video(frames: np.ndarray, out: Path, repeat: int = 1, fps: int = 30) -> Path:
    """RGB frames -> an MJPG AVI (OpenCV writes it without extra codecs)."""
    h, w = frames.shape[1:3]
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    if not writer.isOpened():
        raise SystemExit(f"cannot write {out}")
    for _ in range(repeat):
        for f in frames:
            writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "demo-frames" / "digits")
    ap.add_argument("--video", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with np.load(ROOT / "calibration" / "digits" / "heldout.npz") as z:
        raw, label = z["raw"][-args.count :], z["label"][-args.count :]
    if args.video:
        print(f"wrote {write_video(raw, args.video, args.repeat)} ({len(raw) * args.repeat} frames)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (f, y) in enumerate(zip(raw, label)):
        cv2.imwrite(str(args.out / f"{i:04d}-{LABELS[y]}.png"), cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    print(f"wrote {len(raw)} frames to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
