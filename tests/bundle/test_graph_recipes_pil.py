"""Recipes with resize pil (agent/bundle/graphs/resize_pil.py) in a real session against Pillow itself: the
pre graph's resized levels and post.saliency's 8-bit mask equal Image.resize's bit for bit (rembg's path)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
Image = pytest.importorskip("PIL.Image")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.errors import UsageError  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402

FILTERS = {"linear": "BILINEAR", "cubic": "BICUBIC", "lanczos": "LANCZOS"}
# (frame h, w) -> a 240x320 input: both axes shrink (the height less: horizontal pass first), both grow, one of
# each way (the height shrinking more than the width: vertical first), and one axis unchanged
FRAMES = [(480, 640), (120, 200), (300, 260), (200, 400), (240, 500), (700, 320)]


def session(recipe: str, params: dict[str, Any]) -> ort.InferenceSession:
    return ort.InferenceSession(build_graph(recipe, params).SerializeToString(), providers=[CPU])


def frame(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 150, w)[None, :, None] + np.linspace(0, 60, h)[:, None, None]
    return np.clip(rng.integers(0, 100, (h, w, 3)) + ramp, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("interpolation", list(FILTERS))
def test_pre_stretch_with_resize_pil_equals_pillow_bit_for_bit(interpolation: str) -> None:
    pre = session("pre.stretch", {"width": 320, "height": 240, "resize": "pil", "interpolation": interpolation,
                                  "layout": "nhwc", "dtype": "uint8"})
    for i, (h, w) in enumerate(FRAMES):
        f = frame(h, w, i)
        ours = pre.run(None, {"frame": f})[0][0]
        theirs = np.asarray(Image.fromarray(f).resize((320, 240), getattr(Image.Resampling, FILTERS[interpolation])))
        diff = np.abs(ours.astype(int) - theirs.astype(int))
        assert diff.max() == 0, f"{h}x{w} {interpolation}: {np.count_nonzero(diff)} levels differ, max {diff.max()}"


@pytest.mark.parametrize("frame_hw", [(480, 640), (200, 200), (720, 540), (300, 500)])
def test_post_saliency_with_resize_pil_is_rembgs_mask(frame_hw: tuple[int, int]) -> None:
    """rembg's SimpleSession.predict: min-max, (pred * 255).astype(uint8), LANCZOS to the frame; foreground at
    level >= 127 (its post_process threshold)."""
    rng = np.random.default_rng(frame_hw[0])
    yy, xx = np.mgrid[0:320, 0:320] / 320.0
    d = (np.exp(-((xx - 0.5) ** 2 + (yy - 0.45) ** 2) / 0.04) * 9 - 2 + rng.normal(0, 0.3, (320, 320)))
    d = d[None, None].astype(np.float32)
    post = session("post.saliency", {"input": "d", "resize": "pil", "interpolation": "lanczos", "threshold": 0.498})
    ours = post.run(None, {"d": d, "frame_size": np.array(frame_hw, np.int64),
                           "geometry": np.array([1, 1, 0, 0, 0, 0], np.float32)})[0]
    pred = d[:, 0]
    pred = np.squeeze((pred - pred.min()) / (pred.max() - pred.min()))
    level = np.asarray(Image.fromarray((pred * 255).astype("uint8"), mode="L").resize(frame_hw[::-1], Image.LANCZOS))
    assert ours.dtype == np.uint8 and ours.shape == frame_hw
    assert np.array_equal(ours, (level >= 127).astype(np.uint8)), np.count_nonzero(ours != (level >= 127))
    soft = session("post.saliency", {"input": "d", "resize": "pil", "interpolation": "lanczos"})
    got = soft.run(None, {"d": d, "frame_size": np.array(frame_hw, np.int64),
                          "geometry": np.array([1, 1, 0, 0, 0, 0], np.float32)})[0]
    assert np.array_equal(np.round(got * 255).astype(np.uint8), level)


def test_lanczos_without_resize_pil_is_refused_naming_both_params() -> None:
    with pytest.raises(UsageError, match="interpolation lanczos with resize float"):
        build_graph("pre.stretch", {"interpolation": "lanczos"})
    with pytest.raises(UsageError, match="interpolation nearest with resize pil"):
        build_graph("pre.stretch", {"interpolation": "nearest", "resize": "pil"})
