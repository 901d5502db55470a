"""Broken batched kernels for self-test tests: the tiny bundle's logits shifted in some batch rows only,
as a graph edit of its ONNX model (batch 1 stays exact), and the self-test options that prove them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from agent.proof.selection import SelectionPolicy
from agent.proof.selftest import SelftestOptions


def _shift_logits(model_path: Path, inits: dict[str, np.ndarray], nodes: Callable[[str, str], list]) -> None:
    """Rename the model's output to `<out>_raw`; `nodes(out, input)` build `out` from it with the
    initializers `inits` plus `shift` (+8/-8 on alternate classes)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_path))
    out = m.graph.output[0].name
    for n in m.graph.node:
        n.output[:] = [f"{out}_raw" if o == out else o for o in n.output]
    classes = m.graph.output[0].type.tensor_type.shape.dim[-1].dim_value or 4
    shift = np.array([[8.0 if i % 2 else -8.0 for i in range(classes)]], np.float32)
    m.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in {**inits, "shift": shift}.items())
    m.graph.node.extend(nodes(out, m.graph.input[0].name))
    onnx.checker.check_model(m)
    onnx.save(m, str(model_path))


def wrong_from_row(model_path: Path, row: int) -> None:
    """Shift the logits of batch rows >= `row` only (rows before it exact, batch 1 exact)."""
    from onnx import helper

    _shift_logits(model_path, {"br_zero": np.array([0], np.int64), "br_row": np.array([row], np.int64),
                               "br_end": np.array([2**62], np.int64)}, lambda out, _: [
        helper.make_node("Slice", [f"{out}_raw", "br_zero", "br_row", "br_zero"], ["br_head"]),
        helper.make_node("Slice", [f"{out}_raw", "br_row", "br_end", "br_zero"], ["br_tail"]),
        helper.make_node("Add", ["br_tail", "shift"], ["br_tail2"]),
        helper.make_node("Concat", ["br_head", "br_tail2"], [out], axis=0),
    ])


def wrong_at_batch(model_path: Path, size: int) -> None:
    """Add a shift to the logits only when the batch has `size` rows (a broken batched kernel)."""
    from onnx import TensorProto, helper

    _shift_logits(model_path, {"bq_idx": np.array([0], np.int64), "bq_size": np.array([size], np.int64)},
                  lambda out, inp: [
        helper.make_node("Shape", [inp], ["bq_shape"]),
        helper.make_node("Gather", ["bq_shape", "bq_idx"], ["bq_n"], axis=0),
        helper.make_node("Equal", ["bq_n", "bq_size"], ["bq_eq"]),
        helper.make_node("Cast", ["bq_eq"], ["bq_on"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["shift", "bq_on"], ["bq_delta"]),
        helper.make_node("Add", [f"{out}_raw", "bq_delta"], [out]),
    ])


def batch_opts(max_batch: int) -> SelftestOptions:
    """The int8 variant alone, uncached, 5 timed runs, on the CPU, proven up to `max_batch`."""
    return SelftestOptions(policy=SelectionPolicy(variant="int8"), use_cache=False, latency_runs=5,
                           provider_order=("CPUExecutionProvider",), max_batch=max_batch)
