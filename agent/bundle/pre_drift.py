"""Does the spec's preprocessing reproduce the framework's own input tensors (`input` in a sample set)? The
measured drift against its bound, and when it is over, a guess at the spec key that explains it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

import numpy as np

from agent.bundle.jpeg_hint import jpeg_explains
from agent.bundle.samples import SampleSet
from agent.errors import BundleError
from agent.vocabulary.preprocess import Preprocessor

# Bound on |spec preprocessing - framework input tensor| before the build refuses (tensor units).
DEFAULT_PREPROCESS_DRIFT = 1e-3


def check_preprocess_drift(sets: Sequence[tuple[str, SampleSet, Sequence[np.ndarray]]], layout: str,
                           bound: float, graph_key: str | None = None) -> dict[str, Any]:
    """Compare the spec's tensors with the framework's own input tensors (`input` in a sample set).

    Returns what was measured (empty when no set carries `input`); raises BundleError with the worst
    sample, the max abs and a hint when the difference exceeds `bound`."""
    worst: tuple[float, str, int] = (-1.0, "", -1)
    total = 0
    for label, sset, tensors in sets:
        if sset.framework_inputs is None:
            continue
        for i, t in enumerate(tensors):
            f = np.asarray(sset.framework_inputs[i])
            if f.size != t.size:
                raise BundleError(
                    f"{sset.source}: sample {i}: the framework's input has shape {list(f.shape)}, the spec's "
                    f"preprocessing makes {list(t.shape)} (stage pre): check "
                    + (f"{graph_key} (its output shape)" if graph_key else "preprocess.resize (mode, width, height) and layout")
                )
            d = float(np.max(np.abs(t.astype(np.float64) - f.reshape(t.shape).astype(np.float64)))) if t.size else 0.0
            total += 1
            if not np.isfinite(d) or d > worst[0]:
                worst = (d, f"{label}:{i}", i)
            if not np.isfinite(d):
                break
    if total == 0:
        return {}
    measured, where, _ = worst
    record = {"measured_max_abs": float(f"{measured:.4g}"), "worst_sample": where, "samples": total,
              "bound": bound}
    if not measured <= bound:
        label, index = where.split(":")
        i = int(index)
        sset, tensors = next((s, t) for lab, s, t in sets if lab == label)
        assert sset.framework_inputs is not None  # only sets with the framework's tensors are compared
        raise BundleError(
            f"{sset.source}: stage pre: the spec's preprocessing does not reproduce the framework's input tensors: max "
            f"abs {measured:.4g} on {label} sample {i} (bound {bound:g}); "
            + (f"check {graph_key}" if graph_key else _drift_hint(tensors[i], sset.framework_inputs[i], layout)) +
            f"; or pass --allow-preprocess-drift {float(f'{measured * 1.1:.2g}'):g} to accept it (recorded in the manifest)"
        )
    return record


def explaining_key(pre: Any, frame: Any, sets: Sequence[tuple[str, SampleSet, Sequence[np.ndarray]]],
                   bound: float) -> str | None:
    """A spec change that makes the framework's tensors reproduce, named by its key, or None: the letterbox's
    rounding (packages that int() the resized side differ by up to a whole pixel row on about half of all frame
    sizes, which a mean/scale hint would misname)."""
    r = pre.spec.resize if isinstance(pre, Preprocessor) else None
    if r is None or r.mode != "letterbox":
        return jpeg_explains(pre, frame.color, sets, bound)  # a package that re-encodes each frame as JPEG
    other: Literal["round", "floor"] = "floor" if r.rounding == "round" else "round"
    alt = Preprocessor(dataclasses.replace(pre.spec, resize=dataclasses.replace(r, rounding=other)), frame)
    worst = 0.0
    for _label, sset, _tensors in sets:
        if sset.framework_inputs is None:
            continue
        for i, raw in enumerate(sset.raw):
            t = alt(raw)
            f = np.asarray(sset.framework_inputs[i])
            if f.size != t.size:
                return None
            worst = max(worst, float(np.max(np.abs(t.astype(np.float64) - f.reshape(t.shape).astype(np.float64)))))
            if worst > bound:
                return jpeg_explains(pre, frame.color, sets, bound)
    return f"preprocess.resize.rounding: {other} (with it the max abs is {worst:.4g}, within {bound:g})"


def _drift_hint(t: np.ndarray, f: np.ndarray, layout: str) -> str:
    """A guess at what differs, from the two tensors alone."""
    f = np.asarray(f, np.float64).reshape(t.shape)
    t = t.astype(np.float64)
    axis = {"nchw": -3, "ncw": -2, "nhwc": -1, "nwc": -1}.get(layout, -1)
    if t.ndim >= 3 and t.shape[axis] == 3:
        swapped = np.flip(t, axis=axis)
        if np.max(np.abs(swapped - f)) < 0.5 * np.max(np.abs(t - f)):
            return "the colour order looks swapped (preprocess.color rgb vs bgr)"
    diff = t - f
    if np.std(diff) < 0.05 * max(np.max(np.abs(diff)), 1e-12):
        return f"a constant offset of {float(np.mean(diff)):.4g}: check preprocess.mean"
    ratio = np.std(t) / max(np.std(f), 1e-12)
    if abs(ratio - 1) > 0.05:
        return f"the spread differs by a factor {ratio:.3g}: check preprocess.scale and std"
    return ("differences are spatial: check preprocess.resize (mode, interpolation, anchor, crop) against the "
            "framework's own transform")
