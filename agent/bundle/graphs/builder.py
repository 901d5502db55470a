"""A small ONNX graph builder over onnx.helper: named values, constants and one model per recipe.

Build-time only: `onnx` is imported when a graph is built (the `build` extra), never by serving code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agent.errors import BundleError, install_hint

# Opset 17 and IR 8: every onnxruntime the agent supports (>= 1.17) loads them;
# Resize with `sizes` (13) and NonMaxSuppression (11) are all there. No later op is needed.
OPSET = 17
IR_VERSION = 8

FLOAT, DOUBLE, INT64, UINT8, BOOL, FLOAT16 = "float32", "float64", "int64", "uint8", "bool", "float16"


def need_onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise BundleError("`bundle graph` needs the build tools (onnx): " + install_hint("build", "onnx sympy")) from exc
    return onnx


def _elem(onnx: Any, dtype: str) -> int:
    return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


class Graph:
    """Nodes in order; each op returns the name(s) of its output(s), so a recipe reads like numpy."""

    def __init__(self, name: str):
        self.onnx = need_onnx()
        self.name = name
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self._count = 0

    def _fresh(self, stem: str) -> str:
        # prefixed by the graph's name, so a pre graph, the model and a post graph merge (onnx.compose) unrenamed
        self._count += 1
        return f"{self.name}/{stem}_{self._count}"

    def input(self, name: str, dtype: str, shape: Sequence[int | str | None]) -> str:
        self.inputs.append(self.onnx.helper.make_tensor_value_info(name, _elem(self.onnx, dtype), list(shape)))
        return name

    def output(self, value: str, name: str, dtype: str, shape: Sequence[int | str | None]) -> str:
        """Expose `value` as the graph output `name` (through an Identity when the names differ)."""
        if value != name:
            self.nodes.append(self.onnx.helper.make_node("Identity", [value], [name], name=self._fresh("out")))
        self.outputs.append(self.onnx.helper.make_tensor_value_info(name, _elem(self.onnx, dtype), list(shape)))
        return name

    def const(self, value: Any, dtype: str | None = None) -> str:
        arr = np.asarray(value, dtype=dtype) if dtype else np.asarray(value)
        name = self._fresh("c")
        self.initializers.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs: Any) -> Any:
        outs = [self._fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), outs, name=self._fresh(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # shorthands for what every recipe needs
    def cast(self, x: str, dtype: str) -> str:
        return self.op("Cast", x, to=_elem(self.onnx, dtype))

    def slice(self, x: str, starts: Sequence[int] | str, ends: Sequence[int] | str, axes: Sequence[int]) -> str:
        s = starts if isinstance(starts, str) else self.const(list(starts), INT64)
        e = ends if isinstance(ends, str) else self.const(list(ends), INT64)
        return self.op("Slice", x, s, e, self.const(list(axes), INT64))

    def gather(self, x: str, indices: Sequence[int] | int | str, axis: int = 0) -> str:
        idx = indices if isinstance(indices, str) else self.const(indices, INT64)
        return self.op("Gather", x, idx, axis=axis)

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Squeeze", x, self.const(list(axes), INT64))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), INT64))

    def reshape(self, x: str, shape: Sequence[int] | str) -> str:
        return self.op("Reshape", x, shape if isinstance(shape, str) else self.const(list(shape), INT64))

    def concat(self, xs: Sequence[str], axis: int) -> str:
        return self.op("Concat", *xs, axis=axis)

    def model(self, doc: str) -> Any:
        """The checked model (onnx.checker with full shape inference)."""
        onnx = self.onnx
        graph = onnx.helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = onnx.helper.make_model(graph, producer_name="edge-agent bundle graph",
                                       opset_imports=[onnx.helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        model.doc_string = doc
        onnx.checker.check_model(model, full_check=True)
        return model
