"""Train, export and bundle the demo SENSOR classifier (needs the `build` extra).

A small 1-D CNN on SYNTHETIC 3-axis vibration windows (scripts/vibration_data.py), trained with
PyTorch on tensors made by the agent's own Preprocessor, exported (opset 17, dynamic batch),
checked against ORT, then bundled with `bundle create` (FP32 + static INT8) into
models/vibration-classifier. Also writes models/demo-frames/vibration.f32, a raw little-endian
float32 sample stream (x, y, z interleaved) of all four states for the `file`/`stdin`/`udp` sources.

Usage: python scripts/build_demo_sensor.py [--epochs 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from demo_build import export_check_and_bundle, seeded_setup  # noqa: E402
from vibration_data import CLASSES, WINDOW, signal, windows  # noqa: E402

SEED = 7
SPEC = ROOT / "scripts" / "specs" / "vibration-classifier.yaml"
DATA = ROOT / "calibration" / "vibration"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "vibration-classifier")
    args = ap.parse_args()

    import torch
    import torch.nn as nn

    spec, pre = seeded_setup(SPEC, SEED)
    prep = lambda xs: np.concatenate([pre(x) for x in xs])  # noqa: E731

    train_x, train_y = windows(600, SEED)
    held_x, held_y = windows(100, SEED + 1)

    def block(cin: int, cout: int, k: int, s: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv1d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True))

    net = nn.Sequential(block(3, 16, 7, 2), block(16, 32, 5, 2), block(32, 64, 5, 2), block(64, 64, 3, 1),
                        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, len(CLASSES)))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    x, y = torch.from_numpy(prep(train_x)), torch.from_numpy(train_y)
    hx = torch.from_numpy(prep(held_x))
    for epoch in range(args.epochs):
        net.train()
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            acc = float((net(hx).argmax(1).numpy() == held_y).mean())
        print(f"epoch {epoch + 1}/{args.epochs} held-out top-1 {acc:.4f}", flush=True)

    DATA.mkdir(parents=True, exist_ok=True)
    golden_x = held_x[:16]
    with torch.no_grad():
        golden_ref = net(torch.from_numpy(prep(golden_x))).numpy()
    np.savez_compressed(DATA / "calibration.npz", raw=train_x[:128])
    np.savez_compressed(DATA / "heldout.npz", raw=held_x, label=held_y)
    np.savez_compressed(DATA / "golden.npz", raw=golden_x, **{"reference.scores": golden_ref})
    (DATA / "labels.txt").write_text("\n".join(CLASSES) + "\n")
    if not export_check_and_bundle(net, pre, golden_x, golden_ref, "window", "scores", DATA, SPEC, args.out):
        return 1

    # a demo stream: 3 windows of each state, back to back, in a fixed order
    rng = np.random.default_rng(SEED + 2)
    stream = np.concatenate([signal(c, WINDOW * 3, rng) for c in range(len(CLASSES))])
    out = ROOT / "models" / "demo-frames" / "vibration.f32"
    out.write_bytes(stream.astype("<f4").tobytes())
    print(f"bundle written to {args.out}; demo stream {out} ({len(stream)} samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
