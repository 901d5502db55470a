"""SYNTHETIC 3-axis vibration windows of four simulated machine states, for the sensor demo.

Honest label: this is a physics-flavoured simulation, not measurements. States:
  normal        shaft rotation at f0 (20-35 Hz), small amplitude, broadband noise
  imbalance     strong 1x f0 on the radial axes (x, y), 90 degrees apart
  misalignment  strong 2x and 3x f0 harmonics, with an axial (z) component
  bearing_fault periodic impulses at ~3.6x f0 ringing a 250-380 Hz resonance
"""

from __future__ import annotations

import numpy as np

RATE = 1000.0
WINDOW = 256
CLASSES = ["normal", "imbalance", "misalignment", "bearing_fault"]


def signal(state: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n samples x 3 channels (x, y, z), float32, in g."""
    t = np.arange(n) / RATE
    f0 = rng.uniform(20, 35)
    ph = rng.uniform(0, 2 * np.pi, 3)
    base = 0.15 * np.stack([np.sin(2 * np.pi * f0 * t + ph[0]), np.cos(2 * np.pi * f0 * t + ph[1]),
                            0.3 * np.sin(2 * np.pi * f0 * t + ph[2])], axis=1)
    x = base + rng.normal(0, rng.uniform(0.05, 0.12), (n, 3))
    if state == 1:
        a = rng.uniform(0.6, 1.2)
        x[:, 0] += a * np.sin(2 * np.pi * f0 * t + ph[0])
        x[:, 1] += a * np.cos(2 * np.pi * f0 * t + ph[0])
    elif state == 2:
        a = rng.uniform(0.4, 0.8)
        for k, w in ((2, 1.0), (3, 0.5)):
            x[:, 0] += a * w * np.sin(2 * np.pi * k * f0 * t + ph[1])
            x[:, 2] += 0.8 * a * w * np.sin(2 * np.pi * k * f0 * t + ph[2])
    elif state == 3:
        bpfo = rng.uniform(3.3, 3.9) * f0
        res = rng.uniform(250, 380)
        period = int(RATE / bpfo)
        impulse = np.exp(-np.arange(40) / rng.uniform(4, 8)) * np.sin(2 * np.pi * res * np.arange(40) / RATE)
        train = np.zeros(n + 40)
        for start in range(int(rng.integers(0, period)), n, period):
            train[start : start + 40] += impulse * rng.uniform(0.8, 1.2)
        amp = rng.uniform(0.8, 1.6)
        x[:, 0] += amp * train[:n]
        x[:, 1] += 0.6 * amp * train[:n]
    return x.astype(np.float32)


def windows(count_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(len(CLASSES)):
        for _ in range(count_per_class):
            xs.append(signal(c, WINDOW, rng))
            ys.append(c)
    order = rng.permutation(len(xs))
    return np.stack(xs)[order], np.asarray(ys, np.int64)[order]
