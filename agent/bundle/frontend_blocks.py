"""A block spectrum front-end compiled to ONNX (build time only): numpy.fft.rfft of each whole window, as
magnitude, power or the complex spectrum, for models that take a block's spectrum (DTLN's packages call
np.fft.rfft on each 512-sample block). Part of agent/bundle/frontends.py's vocabulary (`type: rfft`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Rfft:
    """numpy.fft.rfft of each whole window (a block spectrum, as DTLN's package takes it): no centring, no
    padding, the window function `window` (rectangular: none; hann and hamming periodic, as numpy/scipy's
    `sym=False`), then `output`: magnitude, power, or complex. `audio` [B, samples] -> `features`
    [B, 1, F] (magnitude, power) or [B, 1, F, 2] (complex: real, imaginary), F = samples // 2 + 1."""

    samples: int
    window: str = "rectangular"
    output: str = "magnitude"

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise TypeError(f"samples {self.samples} must be >= 2")
        if self.window not in RFFT_WINDOWS:
            raise TypeError(f"window {self.window!r} is not one of {list(RFFT_WINDOWS)}")
        if self.output not in ("magnitude", "power", "complex"):
            raise TypeError(f"output {self.output!r} is not one of ['magnitude', 'power', 'complex']")

    @property
    def out_dims(self) -> list[int]:
        return [1, self.samples // 2 + 1] + ([2] if self.output == "complex" else [])

    def describe(self) -> dict[str, Any]:
        return {"type": "rfft", "samples": self.samples, "window": self.window, "output": self.output}

    def graph(self, opset: int) -> Any:
        return rfft_graph(self, opset)


RFFT_WINDOWS = ("rectangular", "hann", "hamming")


def periodic_window(kind: str, n: int) -> np.ndarray:
    """numpy/scipy's periodic (sym=False) window: hann, hamming, or rectangular (ones)."""
    if kind == "hann":
        return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)
    if kind == "hamming":
        return 0.54 - 0.46 * np.cos(2 * np.pi * np.arange(n) / n)
    return np.ones(n)


def rfft_graph(fe: Rfft, opset: int = 17) -> Any:
    """An ONNX model: `audio` [B, samples] float32 -> `features` [B, 1, F] or [B, 1, F, 2] float32: the
    window and the onesided DFT folded (in float64) into one Conv as wide as the window."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n, f = fe.samples, fe.samples // 2 + 1
    k = np.arange(f)[:, None] * np.arange(n)[None, :] * (2 * np.pi / n)
    kernel = np.concatenate([np.cos(k), -np.sin(k)]) * periodic_window(fe.window, n)[None, :]
    inits = [
        numpy_helper.from_array(kernel.astype(np.float32)[:, None, :], "fe_dft"),  # [2F, 1, n]
        numpy_helper.from_array(np.array([1], np.int64), "fe_axis1"),
        numpy_helper.from_array(np.array([0, 2, f], np.int64), "fe_ri_shape"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["audio", "fe_axis1"], ["fe_x3"]),  # [B, 1, n]
        helper.make_node("Conv", ["fe_x3", "fe_dft"], ["fe_spec"]),  # [B, 2F, 1]
        helper.make_node("Reshape", ["fe_spec", "fe_ri_shape"], ["fe_ri"]),  # [B, 2, F]
    ]
    if fe.output == "complex":
        nodes += [helper.make_node("Transpose", ["fe_ri"], ["fe_fr"], perm=[0, 2, 1]),  # [B, F, 2]
                  helper.make_node("Unsqueeze", ["fe_fr", "fe_axis1"], ["features"])]  # [B, 1, F, 2]
    else:
        nodes += [helper.make_node("Mul", ["fe_ri", "fe_ri"], ["fe_sq"]),
                  helper.make_node("ReduceSum", ["fe_sq", "fe_axis1"],
                                   ["features" if fe.output == "power" else "fe_power"], keepdims=1)]  # [B, 1, F]
        if fe.output == "magnitude":
            nodes.append(helper.make_node("Sqrt", ["fe_power"], ["features"]))
    graph = helper.make_graph(
        nodes, "rfft",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", *fe.out_dims])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(opset, 13))])
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model)
    return model
