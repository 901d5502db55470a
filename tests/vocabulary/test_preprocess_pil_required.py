"""Pillow is a hard requirement of `resampler: pil` (issue 18): without it the bundle's preprocessing is refused
once, naming the key and the fix, instead of a numpy port that had to track every Pillow release."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = """
from agent.errors import PreprocessError
from agent.vocabulary.manifest import FrameSpec, PreprocessSpec, ResizeSpec
from agent.vocabulary.preprocess import Preprocessor
frame = FrameSpec(kind="image", height=40, width=40, channels=3, color="rgb")
for resampler in ("opencv", "pil"):
    spec = PreprocessSpec(layout="nchw", dtype="float32", resize=ResizeSpec(width=32, height=32, interpolation="linear", resampler=resampler))
    try:
        Preprocessor(spec, frame)
        print(resampler, "ok")
    except PreprocessError as exc:
        print(resampler, "refused:", exc)
"""


def test_without_pillow_a_pil_resampler_is_refused_naming_the_key_and_the_fix(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "PIL"  # a real import failure, first on the path
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named PIL (test shadow)')\n")
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}"})
    assert out.stdout.splitlines() == [
        "opencv ok",
        "pil refused: key preprocess.resize.resampler: pil needs Pillow, which is not installed: "
        "pip install '.[pil]' from an edge-agent checkout (or pip install pillow)"]


def test_with_pillow_the_pil_resampler_is_pillow_itself() -> None:
    image = pytest.importorskip("PIL.Image")
    from agent.vocabulary.preprocess import resize_like_pil

    img = np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    assert np.array_equal(resize_like_pil(img, 31, 23, "lanczos"),
                          np.asarray(image.fromarray(img).resize((31, 23), image.LANCZOS)))


def test_the_numpy_port_of_pillows_resize_is_gone() -> None:
    import agent.vocabulary.preprocess as pre

    assert not any(hasattr(pre, n) for n in ("_pil_pass", "_pil_coefficients", "_pil_filter"))
