"""pre.fit_height (issue 42): a grey, aspect-kept, data-dependent-width pre stage stated with a recipe, not the
internal builder: Pillow's resize to a height (LANCZOS by default), the width `int(W * (h / H))`, `convert('L')`,
`/ 255`, against Pillow itself on frames that shrink and grow; OpenCV's grey on request."""

from __future__ import annotations

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from agent.bundle.graphs import build_graph
from agent.errors import UsageError
from agent.testing import structured_frames


def _session(params: dict) -> ort.InferenceSession:
    return ort.InferenceSession(build_graph("pre.fit_height", params).SerializeToString(),
                                providers=["CPUExecutionProvider"])


def _frames() -> list[np.ndarray]:
    base = structured_frames(6, 96, 3)
    # text lines and captchas: wider than tall (portrait frames whose height shrinks differ by 1 to 4 levels on
    # a few percent of values: Pillow's pass order there is not reproduced; docs/recipes.md has the figures)
    sizes = [(31, 90), (64, 200), (99, 250), (40, 41), (120, 300), (57, 300)]
    return [cv2.resize(b, (w, h), interpolation=cv2.INTER_AREA) for b, (h, w) in zip(base, sizes)]


@pytest.mark.parametrize("interpolation,pil", [("lanczos", Image.LANCZOS), ("cubic", Image.BICUBIC),
                                                ("linear", Image.BILINEAR)])
def test_grey_to_height_64_equals_pillow_resize_then_convert_l(interpolation: str, pil: int) -> None:
    s = _session({"input_name": "input1", "interpolation": interpolation})
    for rgb in _frames():
        h, w = rgb.shape[:2]
        want_w = int(w * (64 / h))
        img = Image.fromarray(rgb).resize((want_w, 64), pil).convert("L")
        want = (np.asarray(img).astype(np.float32) / 255.0)[None, None]
        got, geometry = s.run(None, {"frame": rgb})
        assert got.shape == want.shape == (1, 1, 64, want_w)
        assert np.max(np.abs(got - want)) == 0.0, (rgb.shape, interpolation)
        assert np.allclose(geometry, [want_w / w, 64 / h, 0, 0, 0, 0])


def test_cv2_grey_and_bgr_frames() -> None:
    s = _session({"gray": "cv2", "frame_color": "bgr", "resize": "cv2_exact", "interpolation": "linear",
                  "height": 32, "divide": 1.0, "dtype": "uint8"})
    for bgr in _frames():
        h, w = bgr.shape[:2]
        want_w = int(w * (32 / h))
        want = cv2.cvtColor(cv2.resize(bgr, (want_w, 32), interpolation=cv2.INTER_LINEAR), cv2.COLOR_BGR2GRAY)
        got = s.run(None, {"frame": bgr})[0]
        assert got.dtype == np.uint8 and np.array_equal(got[0, 0], want), bgr.shape


def test_lanczos_without_the_pil_resize_is_refused_naming_the_param() -> None:
    with pytest.raises(UsageError, match="lanczos needs resize pil"):
        build_graph("pre.fit_height", {"resize": "float"})
