"""scikit-learn's handwritten digits rendered as camera-like RGB frames (paper, ink, light, blur, noise).

Shared by the demo build scripts and the tests' fixtures; seeded, so every run renders the same frames.
"""

from __future__ import annotations

import cv2
import numpy as np

FRAME = 160


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32) / 16.0, d.target.astype(np.int64)


def render(digit: np.ndarray, rng: np.random.Generator, size: int = FRAME) -> np.ndarray:
    """One 8x8 digit (0..1) -> a size x size RGB uint8 frame as a cheap camera would see it on paper."""
    s = int(rng.uniform(0.45, 0.68) * size)
    glyph = cv2.resize(digit, (s, s), interpolation=cv2.INTER_CUBIC).clip(0, 1)
    canvas = np.zeros((size, size), np.float32)
    off = (size - s) // 2
    canvas[off : off + s, off : off + s] = glyph
    angle = rng.uniform(-15, 15)
    shift = rng.uniform(-0.08, 0.08, size=2) * size
    m = cv2.getRotationMatrix2D((size / 2, size / 2), angle, rng.uniform(0.9, 1.1))
    m[:, 2] += shift
    alpha = cv2.warpAffine(canvas, m, (size, size), flags=cv2.INTER_LINEAR)[..., None]
    paper = rng.uniform(150, 250, size=3).astype(np.float32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    g = rng.uniform(-35, 35, size=2)
    light = (g[0] * (xx - 0.5) + g[1] * (yy - 0.5))[..., None]
    ink = rng.uniform(0, 90, size=3).astype(np.float32)
    img = (paper + light) * (1 - alpha) + ink * alpha
    img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.4, 1.4))
    img += rng.normal(0, rng.uniform(2, 7), size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def render_many(images: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([render(im, rng) for im in images])
