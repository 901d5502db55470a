"""post.saliency (agent/bundle/graphs/post_mask.py) in a real session against U2Net's normPRED
(u2net_test.py: (d - min) / (max - min)) and a half-pixel bilinear resize to the frame, written in numpy."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402


def norm_pred(d: np.ndarray) -> np.ndarray:
    ma, mi = np.max(d), np.min(d)
    return (d - mi) / (ma - mi)


def sample(m: np.ndarray, frame_hw: tuple[int, int], geometry: list[float], input_hw: tuple[int, int]) -> np.ndarray:
    """Each frame pixel centre mapped into the input (x * scale - crop + pad), then into the map, bilinear, clamped."""
    sx, sy, px, py, cx, cy = geometry
    mh, mw = m.shape

    def axis(n: int, s: float, pad: float, crop: float, n_in: int, n_map: int) -> tuple[Any, Any, Any]:
        u = ((np.arange(n) + 0.5) * s - crop + pad) * (n_map / n_in) - 0.5
        u = np.clip(u, 0, n_map - 1)
        u0 = np.floor(u).astype(int)
        return u0, np.minimum(u0 + 1, n_map - 1), u - u0

    y0, y1, fy = axis(frame_hw[0], sy, py, cy, input_hw[0], mh)
    x0, x1, fx = axis(frame_hw[1], sx, px, cx, input_hw[1], mw)
    top = m[y0][:, x0] * (1 - fx) + m[y0][:, x1] * fx
    bottom = m[y1][:, x0] * (1 - fx) + m[y1][:, x1] * fx
    return top * (1 - fy)[:, None] + bottom * fy[:, None]


def saliency_map(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / np.array([h, w])[:, None, None]
    blob = np.exp(-((xx - rng.uniform(0.3, 0.7)) ** 2 + (yy - rng.uniform(0.3, 0.7)) ** 2) / 0.05)
    return (0.1 + 0.7 * blob + rng.uniform(0, 0.1, (h, w)))[None, None].astype(np.float32)


def run(params: dict[str, Any], d: np.ndarray, frame_hw: tuple[int, int], geometry: list[float]) -> np.ndarray:
    sess = ort.InferenceSession(build_graph("post.saliency", params).SerializeToString(), providers=[CPU])
    (mask,) = sess.run(["mask"], {"output": d, "frame_size": np.array(frame_hw, np.int64),
                                   "geometry": np.array(geometry, np.float32)})
    return mask


@pytest.mark.parametrize("frame_hw", [(480, 640), (200, 150), (320, 320)])
def test_stretched_map_is_normalised_and_resized_like_u2net(frame_hw: tuple[int, int]) -> None:
    d = saliency_map(320, 320, seed=frame_hw[0])
    geometry = [320 / frame_hw[1], 320 / frame_hw[0], 0, 0, 0, 0]
    mask = run({}, d, frame_hw, geometry)
    pred = norm_pred(d[0, 0].astype(np.float64))
    assert mask.shape == frame_hw and mask.dtype == np.float32
    np.testing.assert_allclose(mask, sample(pred, frame_hw, geometry, (320, 320)), atol=1e-4)
    # for a stretch that is cv2's INTER_LINEAR resize of the normalised map
    np.testing.assert_allclose(mask, cv2.resize(pred.astype(np.float32), frame_hw[::-1], interpolation=cv2.INTER_LINEAR),
                               atol=1e-4)
    assert mask.min() >= -1e-6 and mask.max() <= 1 + 1e-6


@pytest.mark.parametrize("frame_hw", [(480, 640), (700, 300)])
def test_a_quarter_size_map_through_a_letterbox_skips_the_pad(frame_hw: tuple[int, int]) -> None:
    s = min(320 / frame_hw[0], 320 / frame_hw[1])
    pad_x, pad_y = (320 - round(frame_hw[1] * s)) // 2, (320 - round(frame_hw[0] * s)) // 2
    geometry = [s, s, pad_x, pad_y, 0, 0]
    d = saliency_map(80, 80, seed=1)
    mask = run({"width": 320, "height": 320}, d, frame_hw, geometry)
    np.testing.assert_allclose(mask, sample(norm_pred(d[0, 0].astype(np.float64)), frame_hw, geometry, (320, 320)),
                               atol=1e-4)


def test_threshold_gives_a_binary_mask_and_sigmoid_applies_first() -> None:
    d = saliency_map(64, 64, seed=2)
    logits = np.log(d / (1 - d))
    frame_hw, geometry = (100, 120), [64 / 120, 64 / 100, 0, 0, 0, 0]
    mask = run({"sigmoid": True, "threshold": 0.5}, logits, frame_hw, geometry)
    ref = sample(norm_pred(d[0, 0].astype(np.float64)), frame_hw, geometry, (64, 64))
    assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}
    assert np.mean(mask == (ref >= 0.5)) > 0.999 and 0.05 < mask.mean() < 0.95


def test_a_constant_map_is_finite() -> None:
    mask = run({}, np.full((1, 1, 16, 16), 0.3, np.float32), (20, 20), [0.8, 0.8, 0, 0, 0, 0])
    assert np.isfinite(mask).all()
