"""Sample sets for `bundle create`: calibration, golden and held-out frames, with optional labels
and reference outputs.

A sample set is either an `.npz` (array `raw` of N frames, optional `label` (N,), optional
`reference.<output>` (N, ...), optional `input` (N, ...): the framework's own input tensors, to prove
the bundle's preprocessing reproduces them) or a directory of image files (sorted by name) and/or
`.npy` windows. For a stateful model each of the N samples is a sequence: `raw` (N, T, ...), and
`reference.<output>` / `input` carry a row per step (N, T, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agent.errors import BundleError
from agent.npio import open_npz, read_npy
from agent.vocabulary.manifest import FrameSpec
from agent.vocabulary.preprocess import IMAGE_SUFFIXES, read_image_file


class LazyFrames(Sequence[np.ndarray]):
    """Files of a sample directory, decoded when indexed: a calibration set is never all in memory."""

    def __init__(self, files: list[Path], frame: FrameSpec):
        self.files, self.frame = files, frame

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: Any) -> Any:  # Sequence's overloads: an int gives a frame, a slice a list
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = self.files[i]
        return read_npy(p) if p.suffix == ".npy" else read_image(p, self.frame)


@dataclass(frozen=True)
class SampleSet:
    source: Path
    raw: Sequence[np.ndarray]
    labels: np.ndarray | None = None
    references: dict[str, np.ndarray] = field(default_factory=dict)
    framework_inputs: np.ndarray | None = None  # npz key `input`: the framework's own input tensors

    def __len__(self) -> int:
        return len(self.raw)


def read_image(path: Path, frame: FrameSpec) -> np.ndarray:
    img = read_image_file(str(path), frame)
    if img is None:
        raise BundleError(f"{path}: cannot decode image")
    return img


def load_samples(path: Path | str, frame: FrameSpec, limit: int | None = None, lazy: bool = False) -> SampleSet:
    """`lazy`: a directory's files are decoded when used (calibration); an .npz is read at once."""
    path = Path(path)
    if path.suffix == ".npz":
        try:
            with open_npz(path) as z:
                if "raw" not in z.files:
                    raise BundleError(f"{path}: sample set .npz needs an array 'raw' (has {z.files})")
                raw = z["raw"]
                n = len(raw) if limit is None else min(limit, len(raw))
                labels = z["label"][:n] if "label" in z.files else None
                refs = {k.removeprefix("reference."): z[k][:n] for k in z.files if k.startswith("reference.")}
                inputs = z["input"][:n] if "input" in z.files else None
                frames = [np.ascontiguousarray(raw[i]) for i in range(n)]
        except (OSError, ValueError) as exc:
            raise BundleError(f"{path}: cannot read sample set: {exc}") from exc
        if inputs is not None and len(inputs) != n:
            raise BundleError(f"{path}: 'input' has {len(inputs)} samples, 'raw' has {n}: one framework tensor per sample")
        for key, arr in [("label", labels), *((f"reference.{k}", v) for k, v in refs.items())]:
            if arr is not None and len(arr) != n:
                raise BundleError(f"{path}: {key!r} has {len(arr)} samples, 'raw' has {n}: one row per sample")
        return SampleSet(path, frames, labels, refs, inputs)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES + (".npy",))
        if limit is not None:
            files = files[:limit]
        if not files:
            raise BundleError(f"{path}: no image or .npy samples in this directory")
        lazy_frames = LazyFrames(files, frame)
        return SampleSet(path, lazy_frames if lazy else list(lazy_frames))
    raise BundleError(f"{path}: a sample set is an .npz file or a directory of images / .npy windows")
