"""The device's preprocessing against the bundled tensors: equal, a rounding difference of the image library (every
value within one step of the 8-bit source, no offset), or another preprocessing, with the key that most likely explains it.

Pure numpy. Why a rounding rule at all: OpenCV's INTER_LINEAR (and its colour conversions) round differently on
arm64 NEON than on x86 SSE/AVX (the same OpenCV release moved 27 % of the shipped demo's values by one level), so an
exact bound refuses every correct ARM device; a wrong mean, std, colour order or size still moves values by more than
a level, or all of them one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A rounding difference moves each value by at most this many source levels...
ROUNDING_MAX_LEVELS = 1.0
# ...and leaves each channel's mean where it was: at most this many levels of signed mean difference. Rounding that
# differs in one direction only on every flipped value (arm64's resize: 27 % of values) gives 0.27; a mean wrong by one
# level gives 1.0 on every value.
ROUNDING_MAX_BIAS = 0.5
# Float slack on "one level": levels computed from float32 tensors.
_LEVEL_SLACK = 1e-3


@dataclass(frozen=True)
class Levels:
    """What one step of the 8-bit source is in tensor units, per channel, and where the channel axis is
    (negative: from the end, so batch and sequence axes in front do not matter)."""

    step: tuple[float, ...]
    offset: tuple[float, ...]  # the tensor value of source level 0 is -offset (x = level * step - offset)
    channel_axis: int


@dataclass(frozen=True)
class SampleDiff:
    """One golden sample's device tensor against the bundled one."""

    max_abs: float
    differing: float = 0.0  # fraction of values that differ more than the exact bound
    max_levels: float | None = None  # worst |difference| in source levels (None: levels unknown or shapes differ)
    bias_levels: float | None = None  # worst per-channel |mean signed difference| in levels
    # worst distance of a difference from a whole number of levels, beyond the float rounding of the tensor's dtype:
    # two 8-bit images through the same scale, mean and std differ by whole levels only; a mean, std or scale a
    # little off moves every value by a fraction of one
    off_grid_levels: float | None = None

    def within(self, max_levels: float = ROUNDING_MAX_LEVELS) -> bool:
        """Only the image library's rounding: whole source levels, within `max_levels` (at most one) everywhere,
        no channel moved as a whole."""
        bound = min(max_levels, ROUNDING_MAX_LEVELS)
        return (bound > 0 and self.max_levels is not None and self.bias_levels is not None
                and self.off_grid_levels is not None and self.max_levels <= bound + _LEVEL_SLACK
                and self.bias_levels <= ROUNDING_MAX_BIAS and self.off_grid_levels <= _LEVEL_SLACK)


def _per_channel(a: np.ndarray, axis: int) -> np.ndarray:
    """(channels, values) view of an array with its channel axis at `axis`."""
    moved = np.moveaxis(a, axis, 0)
    return moved.reshape(moved.shape[0], -1)


def compare(device: np.ndarray, bundled: np.ndarray, levels: Levels | None, exact_bound: float) -> SampleDiff:
    """How far the device's tensor is from the bundled one, in tensor units and (with `levels`) in source levels."""
    if device.shape != bundled.shape:
        return SampleDiff(float("inf"))
    dev, ref = device.astype(np.float64), bundled.astype(np.float64)
    diff = dev - ref
    diff[np.isnan(dev) & np.isnan(ref)] = 0.0  # NaN where the bundle holds NaN too: the same value
    if not np.all(np.isfinite(diff)):  # NaN compares false with every bound: a NaN or Inf of its own is no rounding
        return SampleDiff(float("inf"), float(np.mean(~np.isfinite(diff) | (np.abs(diff) > exact_bound))))
    mag = np.abs(diff)
    max_abs = float(mag.max()) if mag.size else 0.0
    if max_abs <= exact_bound:  # the usual case, every proof on the build's own kind of CPU: nothing more to read
        return SampleDiff(max_abs)
    differing = float(np.mean(mag > exact_bound))
    if levels is None or mag.size == 0 or device.ndim < -levels.channel_axis:
        return SampleDiff(max_abs, differing)
    d = _per_channel(diff, levels.channel_axis)
    if d.shape[0] != len(levels.step):
        return SampleDiff(max_abs, differing)
    step = np.abs(np.asarray(levels.step, dtype=np.float64))[:, None]
    in_levels = d / step
    whole = np.round(in_levels)
    if np.issubdtype(device.dtype, np.floating) and np.issubdtype(bundled.dtype, np.floating):
        # each tensor is rounded once to its dtype: at most one ulp of the largest value apart for the same level
        eps = float(max(np.finfo(device.dtype).eps, np.finfo(bundled.dtype).eps))
        float_slack = eps * float(np.abs(ref).max()) / float(step.min())
        off_grid = max(0.0, float(np.abs(in_levels - whole).max()) - float_slack)
    else:  # raw pixels (uint8/int8 inputs take no scale, mean or std): whole levels by construction
        off_grid = 0.0
    # on the grid, the whole levels are the difference (a float16 tensor's own rounding read 1 level as 1.06)
    counted = whole if off_grid <= _LEVEL_SLACK else in_levels
    return SampleDiff(max_abs, differing, float(np.abs(counted).max()), float(np.abs(counted.mean(axis=1)).max()),
                      off_grid)


def lattice_levels(bundled: np.ndarray) -> Levels | None:
    """The 8-bit source's step read from a bundled tensor a pre graph made (its scale, mean and std are inside the
    graph, not in the manifest): per channel, its values must sit on one grid of at most 256 levels (an 8-bit
    picture through an affine map); the grid's step is then one level. None when they do not (a float resize that
    never rounds back to 8 bits: exact only), when the channel axis cannot be told, or a channel is flat."""
    axis = -3 if bundled.ndim >= 3 and bundled.shape[-3] in (1, 3, 4) else (
        -1 if bundled.ndim >= 1 and bundled.shape[-1] in (1, 3, 4) else 0)
    if axis == 0 or not np.issubdtype(bundled.dtype, np.floating) and not np.issubdtype(bundled.dtype, np.integer):
        return None
    steps, offsets = [], []
    for values in _per_channel(bundled.astype(np.float64), axis):
        u = np.unique(values[np.isfinite(values)])
        if len(u) < 2 or len(u) > 256:
            return None
        step = float(np.diff(u).min())
        index = (u - u[0]) / step
        eps = float(np.finfo(bundled.dtype).eps) * float(np.abs(u).max()) / step if np.issubdtype(
            bundled.dtype, np.floating) else 0.0
        if step <= 0 or float(np.abs(index - np.round(index)).max()) > _LEVEL_SLACK + eps or index[-1] > 255.5:
            return None
        steps.append(step)
        offsets.append(-float(u[0]))  # the lowest value present taken as level 0: explain() reads shifts relative
    return Levels(tuple(steps), tuple(offsets), axis)


def explain(device: np.ndarray, bundled: np.ndarray, levels: Levels | None) -> str:
    """The manifest key most likely to explain a difference beyond rounding, read from the source pixels both
    tensors stand for (each undone with the device's own scale, mean and std)."""
    if device.shape != bundled.shape:
        return (f"the device makes a tensor of shape {list(device.shape)} where the bundle holds "
                f"{list(bundled.shape)}: check preprocess.resize and preprocess.layout")
    dev_f, ref_f = device.astype(np.float64), bundled.astype(np.float64)
    own = ~np.isfinite(dev_f) & ~(np.isnan(dev_f) & np.isnan(ref_f))
    if own.any():
        return (f"the device's tensor holds {int(own.sum())} NaN/Inf value(s) the bundled one does not: its "
                "preprocessing computes no number there (a division by zero, a std of 0)")
    if levels is None:
        return ""
    step = np.asarray(levels.step, dtype=np.float64)[:, None]
    offset = np.asarray(levels.offset, dtype=np.float64)[:, None]
    dev = (_per_channel(device.astype(np.float64), levels.channel_axis) + offset) / step
    ref = (_per_channel(bundled.astype(np.float64), levels.channel_axis) + offset) / step
    if dev.shape[0] != step.shape[0]:
        return ""
    near = ROUNDING_MAX_LEVELS + 0.5
    # reversed channels only where reversing changes the picture (R = G = B fits any small shift reversed)
    if dev.shape[0] == 3 and np.abs(ref - ref[::-1]).max() > near and np.abs(dev - ref[::-1]).max() <= near:
        return "the channels are in reverse order: check preprocess.color (and the frame's color)"
    gains, shifts, fits = [], [], True
    for c in range(dev.shape[0]):
        x, y = ref[c], dev[c]
        if np.ptp(x) < 1:  # a flat channel: only the shift can be told
            gains.append(1.0)
            shifts.append(float(np.mean(y - x)))
            fits = fits and float(np.abs(y - x - shifts[-1]).max()) <= near
            continue
        gain, shift = np.polyfit(x, y, 1)
        gains.append(float(gain))
        shifts.append(float(shift))
        fits = fits and float(np.abs(y - (gain * x + shift)).max()) <= near
    # a gain counts once it moves the channel's picture apart by a quarter level (1 % of 255 levels is 2.5)
    if fits and all(abs(g - 1.0) * max(float(np.ptp(x)), 1.0) <= 0.25 for g, x in zip(gains, ref)):
        moved = ", ".join(f"{s:+.2f}" for s in shifts)
        return f"every value of a channel moved by a constant ({moved} source levels per channel): check preprocess.mean"
    if fits:
        scaled = ", ".join(f"x{g:.4f}" for g in gains)
        return f"values scaled per channel ({scaled}): check preprocess.std and preprocess.scale"
    return ("the picture itself differs (size, crop, interpolation, resampler or colour conversion): check "
            "preprocess.resize and preprocess.color")


__all__ = ["ROUNDING_MAX_BIAS", "ROUNDING_MAX_LEVELS", "Levels", "SampleDiff", "compare", "explain", "lattice_levels"]
