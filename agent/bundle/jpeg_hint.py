"""When the spec's tensors differ from the package's like JPEG loss, `bundle create` names `preprocess.jpeg_roundtrip`.

A package that re-encodes every frame as JPEG before inference feeds its model tensors tens of levels off the
frame's (blocky, in 8x8 tiles, on edges and colour): a mean, scale or resize hint would misname it. The build
tries the round trip at a few qualities on the samples whose package tensors it has, and names the key with the
quality that explains the difference (within the bound), or, where none fits the bound, the quality that
shrinks it most when it shrinks it at least FACTOR times (the package's encoder may differ from OpenCV's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agent.vocabulary.jpeg_roundtrip import KEY, roundtrip

QUALITIES = (95, 90, 85, 80, 75, 70, 60, 50)
FACTOR = 4.0  # "looks like JPEG loss": a round trip shrinks the worst difference at least this many times
MAX_SAMPLES = 8  # the hint runs the preprocessing per quality: a few samples say it


def _worst(pre: Callable[[np.ndarray], np.ndarray], pairs: Sequence[tuple[np.ndarray, np.ndarray]],
           step: Callable[[np.ndarray], np.ndarray] | None) -> float | None:
    worst = 0.0
    for raw, f in pairs:
        t = pre(step(raw) if step else raw)
        if t.size != f.size:
            return None
        worst = max(worst, float(np.max(np.abs(t.astype(np.float64) - f.reshape(t.shape).astype(np.float64)))))
    return worst


def _step(quality: int, color: str) -> Callable[[np.ndarray], np.ndarray]:
    return lambda raw: roundtrip(raw, quality, color)


def jpeg_explains(pre: Any, color: str, sets: Sequence[tuple[str, Any, Sequence[np.ndarray]]],
                  bound: float) -> str | None:
    """`preprocess.jpeg_roundtrip: {quality: Q}` and what it measured, when a JPEG round trip explains the
    difference between the spec's tensors and the package's; None otherwise (or when already declared)."""
    if getattr(getattr(pre, "spec", None), "jpeg_roundtrip", None) is not None:
        return None
    pairs = [(raw, np.asarray(s.framework_inputs[i])) for _label, s, _t in sets if s.framework_inputs is not None
             for i, raw in enumerate(s.raw) if getattr(raw, "ndim", 0) == 3][:MAX_SAMPLES]
    if not pairs:
        return None
    try:
        plain = _worst(pre, pairs, None)
        if not plain:
            return None
        tried = [(q, _worst(pre, pairs, _step(q, color))) for q in QUALITIES]
    except Exception:  # noqa: BLE001 -- a hint never hides the refusal it explains
        return None
    fits = [(w, q) for q, w in tried if w is not None]
    if not fits:
        return None
    best, q = min(fits)
    if best <= bound:
        return f"{KEY}: {{quality: {q}}} (with it the max abs is {best:.4g}, within {bound:g})"
    if best * FACTOR <= plain:
        return (f"{KEY}: {{quality: ...}}: the difference looks like JPEG loss (a round trip at quality {q} brings "
                f"the max abs from {plain:.4g} to {best:.4g}, still over {bound:g}: the package's encoder or quality "
                f"differs)")
    return None
