"""What `preprocess.jpeg_roundtrip` costs per frame: the declarative preprocessing of the same frames with and
without the step, interleaved (with / without / with / ...), at several frame sizes, on one thread.

The figure is the median CPU time per frame of each, the ratio with / without, and the load average before and
after (the machine these numbers come from is shared). The step is one OpenCV JPEG encode and decode of the raw
frame (agent/vocabulary/jpeg_roundtrip.py), so its cost grows with the frame, not with the model input.

Usage: python scripts/bench_jpeg_roundtrip.py [--rounds 200] [--quality 95]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import cv2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.vocabulary.jpeg_roundtrip import JpegRoundtrip  # noqa: E402
from agent.vocabulary.manifest import FrameSpec, PreprocessSpec, ResizeSpec  # noqa: E402
from agent.vocabulary.preprocess import Preprocessor  # noqa: E402
from agent.testing import structured_frames  # noqa: E402

SIZES = ((480, 640), (720, 1280), (1080, 1920))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--quality", type=int, default=95)
    args = p.parse_args()
    cv2.setNumThreads(1)
    load0 = os.getloadavg()
    print("| frame | without (ms) | with jpeg_roundtrip (ms) | ratio |")
    print("|---|---|---|---|")
    for h, w in SIZES:
        frame = cv2.resize(structured_frames(1, 256, 3)[0], (w, h), interpolation=cv2.INTER_LINEAR)
        spec = PreprocessSpec(layout="nchw", resize=ResizeSpec(mode="letterbox", width=640, height=640),
                              scale=1 / 255)
        fs = FrameSpec(kind="image", height=h, width=w, channels=3, color="rgb")
        plain = Preprocessor(spec, fs)
        jpeg = Preprocessor(dataclasses.replace(spec, jpeg_roundtrip=JpegRoundtrip(args.quality)), fs)
        times: dict[str, list[float]] = {"plain": [], "jpeg": []}
        for i in range(args.rounds):
            for name, pre in (("plain", plain), ("jpeg", jpeg)) if i % 2 == 0 else (("jpeg", jpeg), ("plain", plain)):
                t0 = time.thread_time_ns()
                pre(frame)
                times[name].append((time.thread_time_ns() - t0) / 1e6)
        a, b = statistics.median(times["plain"]), statistics.median(times["jpeg"])
        print(f"| {w}x{h} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    load1 = os.getloadavg()
    print(f"\nCPU time per frame (thread), medians of {args.rounds}, quality {args.quality}, one OpenCV thread; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
