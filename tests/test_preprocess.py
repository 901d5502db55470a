"""One preprocessing path: colour order, resize/letterbox, normalisation, layout, and bad frames refused."""

from __future__ import annotations

import numpy as np
import pytest

from agent.errors import PreprocessError
from agent.spec.manifest import FrameSpec, PreprocessSpec, ResizeSpec
from agent.spec.preprocess import Preprocessor, fit_geometry


def _img(h: int, w: int, value=(10, 20, 30)) -> np.ndarray:
    return np.full((h, w, 3), value, np.uint8)


def test_normalisation_and_nchw_layout_match_the_textbook_formula() -> None:
    spec = PreprocessSpec(layout="nchw", dtype="float32", scale=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    pre = Preprocessor(spec, FrameSpec("image", 4, 4, 3, "rgb"))
    raw = np.random.default_rng(0).integers(0, 255, (4, 4, 3), dtype=np.uint8)
    want = ((raw / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.25, 0.5])).transpose(2, 0, 1)[None]
    assert np.allclose(pre(raw), want, atol=1e-5)


def test_bgr_frames_are_converted_to_the_models_rgb() -> None:
    pre = Preprocessor(PreprocessSpec(layout="nhwc", dtype="float32", color="rgb"), FrameSpec("image", 2, 2, 3, "bgr"))
    out = pre(_img(2, 2, (1, 2, 3)))
    assert out.shape == (1, 2, 2, 3) and list(out[0, 0, 0]) == [3, 2, 1]


def test_letterbox_keeps_aspect_and_pads_and_maps_boxes_back() -> None:
    r = ResizeSpec(width=8, height=8, mode="letterbox", pad_value=0)
    pre = Preprocessor(PreprocessSpec(layout="nhwc", dtype="float32", resize=r), FrameSpec("image", 4, 8, 3, "rgb"))
    out = pre(_img(4, 8, (100, 100, 100)))
    assert out.shape == (1, 8, 8, 3)
    assert out[0, 0, :, 0].max() == 0 and out[0, 4, :, 0].min() == 100  # top padded, middle filled
    g = fit_geometry(4, 8, r)
    assert (g.scale_x, g.pad_y) == (1.0, 2)
    assert np.allclose(g.to_frame(np.array([[0, 2, 8, 6]], np.float32)), [[0, 0, 8, 4]])


def test_sensor_windows_become_ncw() -> None:
    pre = Preprocessor(PreprocessSpec(layout="ncw", dtype="float32", scale=0.5), FrameSpec("sensor", window=6, channels=2))
    out = pre(np.arange(12, dtype=np.float32).reshape(6, 2))
    assert out.shape == (1, 2, 6) and out[0, 1, 0] == 0.5


@pytest.mark.parametrize(
    "frame, message",
    [
        (np.zeros((4, 4), np.uint8), "channel"),
        (np.zeros((4, 4, 4), np.uint8), "channel"),
        (np.zeros((4, 4, 3), np.float32), "dtype float32 is not uint8"),
        (np.zeros((5, 4, 3), np.uint8), "declares no resize"),
    ],
)
def test_bad_image_frames_are_refused_with_the_reason(frame: np.ndarray, message: str) -> None:
    pre = Preprocessor(PreprocessSpec(layout="nchw", dtype="float32"), FrameSpec("image", 4, 4, 3, "rgb"))
    with pytest.raises(PreprocessError, match=message):
        pre(frame)


def test_sensor_window_of_wrong_length_is_refused() -> None:
    pre = Preprocessor(PreprocessSpec(layout="ncw", dtype="float32"), FrameSpec("sensor", window=6, channels=2))
    with pytest.raises(PreprocessError, match=r"\(5, 2\) is not \(6, 2\)"):
        pre(np.zeros((5, 2), np.float32))
