"""Every row of every proven batch is judged. With fewer golden samples than the micro-batch (16
samples, batches of 32 on a GPU), a batch filled round-robin repeats samples, and only each sample's
first row was judged: a batched kernel wrong only in rows past the golden count passed as proven."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.bundle.load import load_bundle
from agent.proof.selection import SelectionPolicy
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.testing import rewrite_manifest


def _wrong_from_row(model_path: Path, row: int) -> None:
    """Shift the logits of batch rows >= `row` only (rows before it exact, batch 1 exact)."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(model_path))
    out = m.graph.output[0].name
    for n in m.graph.node:
        n.output[:] = [f"{out}_raw" if o == out else o for o in n.output]
    classes = m.graph.output[0].type.tensor_type.shape.dim[-1].dim_value or 4
    shift = np.array([[8.0 if i % 2 else -8.0 for i in range(classes)]], np.float32)
    m.graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "br_zero"),
                                numpy_helper.from_array(np.array([row], np.int64), "br_row"),
                                numpy_helper.from_array(np.array([2**62], np.int64), "br_end"),
                                numpy_helper.from_array(shift, "br_shift")])
    m.graph.node.extend([
        helper.make_node("Slice", [f"{out}_raw", "br_zero", "br_row", "br_zero"], ["br_head"]),
        helper.make_node("Slice", [f"{out}_raw", "br_row", "br_end", "br_zero"], ["br_tail"]),
        helper.make_node("Add", ["br_tail", "br_shift"], ["br_tail2"]),
        helper.make_node("Concat", ["br_head", "br_tail2"], [out], axis=0),
    ])
    onnx.checker.check_model(m)
    onnx.save(m, str(model_path))


def _opts(max_batch: int) -> SelftestOptions:
    return SelftestOptions(policy=SelectionPolicy(variant="int8"), use_cache=False, latency_runs=5,
                           provider_order=("CPUExecutionProvider",), max_batch=max_batch)


def test_a_variant_wrong_only_in_rows_past_the_golden_count_is_rejected(tiny_bundle: Path) -> None:
    n = len(load_bundle(tiny_bundle).golden())
    _wrong_from_row(tiny_bundle / "model_int8.onnx", n)
    rewrite_manifest(tiny_bundle)
    bundle = load_bundle(tiny_bundle)
    assert run_selftest(bundle, None, _opts(n)).selected is not None  # no batch of n rows reaches row n
    report = run_selftest(bundle, None, _opts(n + 1))  # serving's batch of n+1 frames: row n is wrong
    assert report.selected is None, f"served with row {n} of a batch of {n + 1} wrong"
    int8 = next(r for r in report.results if r.candidate.variant == "int8")
    found = [f for f in int8.findings if f.check == "reproduction"]
    assert found and found[0].stage == f"batch {n + 1}", int8.reasons
