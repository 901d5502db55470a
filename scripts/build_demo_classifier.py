"""Train, export and bundle the demo image classifier (needs the `build` extra).

1. scikit-learn digits -> camera-like 160x160 RGB frames (scripts/digits_data.py), seeded split:
   70% train (fresh renders every epoch), 30% held out.
2. A MobileNet-style CNN (depthwise-separable blocks, 128x128 input, ~136 M MACs) trained with PyTorch
   on tensors made by the agent's own Preprocessor, so training and serving share preprocessing.
3. torch.onnx.export (opset 17, dynamic batch); ORT checked against PyTorch on the golden frames.
4. calibration/digits/ gets calibration, held-out and golden sets; `bundle create` makes
   models/digits-classifier (FP32 + static INT8) from them.

Usage: python scripts/build_demo_classifier.py [--epochs N] [--out models/digits-classifier]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from demo_build import export_check_and_bundle, seeded_setup  # noqa: E402
from digits_data import load_digits_arrays, render_many  # noqa: E402

SEED = 20261129
SPEC = ROOT / "scripts" / "specs" / "digits-classifier.yaml"
DATA = ROOT / "calibration" / "digits"
LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def build_net():
    import torch.nn as nn

    def block(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
            nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        block(32, 64, 1), block(64, 128, 2), block(128, 128, 1), block(128, 256, 2),
        block(256, 256, 1), block(256, 256, 1), block(256, 512, 2), block(512, 512, 1), block(512, 512, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(512, 10),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "digits-classifier")
    args = ap.parse_args()

    import torch

    spec, pre = seeded_setup(SPEC, SEED)

    images, labels = load_digits_arrays()
    order = np.random.default_rng(SEED).permutation(len(images))
    n_train = int(0.7 * len(images))
    tr, ho = order[:n_train], order[n_train:]
    held_raw = render_many(images[ho], SEED + 1)
    held_x = np.concatenate([pre(f) for f in held_raw])

    net = build_net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.epochs * ((n_train + 63) // 64))
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.05)
    for epoch in range(args.epochs):
        t0 = time.time()
        raw = render_many(images[tr], SEED + 100 + epoch)  # fresh augmentation every epoch
        x = torch.from_numpy(np.concatenate([pre(f) for f in raw]))
        y = torch.from_numpy(labels[tr])
        net.train()
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            loss = loss_fn(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        net.eval()
        with torch.no_grad():
            acc = float((net(torch.from_numpy(held_x)).argmax(1).numpy() == labels[ho]).mean())
        print(f"epoch {epoch + 1}/{args.epochs} loss {total / len(x):.4f} held-out top-1 {acc:.4f} ({time.time() - t0:.0f}s)",
              flush=True)

    DATA.mkdir(parents=True, exist_ok=True)
    calib_raw = render_many(images[tr[:128]], SEED + 2)
    golden_idx = ho[:16]
    golden_raw = held_raw[:16]
    with torch.no_grad():
        golden_ref = net(torch.from_numpy(np.concatenate([pre(f) for f in golden_raw]))).numpy()
    np.savez_compressed(DATA / "calibration.npz", raw=calib_raw)
    np.savez_compressed(DATA / "heldout.npz", raw=held_raw, label=labels[ho])
    np.savez_compressed(DATA / "golden.npz", raw=golden_raw, label=labels[golden_idx], **{"reference.logits": golden_ref})
    (DATA / "labels.txt").write_text("\n".join(LABELS) + "\n")

    if not export_check_and_bundle(net, pre, golden_raw, golden_ref, "input", "logits", DATA, SPEC, args.out):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
