"""The self-test proves every batch size serving will run: a variant exact at batch 1 and wrong at
batch 4 is rejected when serving micro-batches up to 4 (it served 34/48 correct where FP32 served 47/48)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.bundle.load import load_bundle
from agent.config import Config, PipelineConfig
from agent.proof.selection import SelectionPolicy
from agent.proof.selftest import (
    SelftestOptions,
    batch_sizes,
    options_from_config,
    run_selftest,
)
from agent.testing import rewrite_manifest


def _wrong_at_batch(model_path: Path, size: int) -> None:
    """Add a shift to the logits only when the batch has `size` rows (a broken batched kernel)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(model_path))
    out = m.graph.output[0].name
    for n in m.graph.node:
        n.output[:] = [f"{out}_raw" if o == out else o for o in n.output]
    classes = m.graph.output[0].type.tensor_type.shape.dim[-1].dim_value or 4
    shift = np.array([[8.0 if i % 2 else -8.0 for i in range(classes)]], np.float32)
    m.graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "bq_idx"),
                                numpy_helper.from_array(np.array([size], np.int64), "bq_size"),
                                numpy_helper.from_array(shift, "bq_shift")])
    m.graph.node.extend([
        helper.make_node("Shape", [m.graph.input[0].name], ["bq_shape"]),
        helper.make_node("Gather", ["bq_shape", "bq_idx"], ["bq_n"], axis=0),
        helper.make_node("Equal", ["bq_n", "bq_size"], ["bq_eq"]),
        helper.make_node("Cast", ["bq_eq"], ["bq_on"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["bq_shift", "bq_on"], ["bq_delta"]),
        helper.make_node("Add", [f"{out}_raw", "bq_delta"], [out]),
    ])
    onnx.checker.check_model(m)
    onnx.save(m, str(model_path))


def _opts(max_batch: int) -> SelftestOptions:
    return SelftestOptions(policy=SelectionPolicy(variant="int8"), use_cache=False, latency_runs=5,
                           provider_order=("CPUExecutionProvider",), max_batch=max_batch)


def test_a_variant_wrong_only_at_batch_4_is_rejected_when_serving_batches_up_to_4(tiny_bundle: Path) -> None:
    _wrong_at_batch(tiny_bundle / "model_int8.onnx", 4)
    rewrite_manifest(tiny_bundle)
    bundle = load_bundle(tiny_bundle)
    assert run_selftest(bundle, None, _opts(1)).selected is not None  # exact at batch 1: batch 1 cannot see it
    assert run_selftest(bundle, None, _opts(3)).selected is not None  # sizes 2 and 3 are fine too
    report = run_selftest(bundle, None, _opts(4))
    assert report.selected is None
    int8 = next(r for r in report.results if r.candidate.variant == "int8")
    found = [f for f in int8.findings if f.check == "reproduction"]
    assert found and found[0].stage == "batch 4", int8.reasons


def test_the_batch_sizes_proven_follow_the_serving_configuration(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    assert batch_sizes(bundle, 1) == () and batch_sizes(bundle, 4) == (2, 3, 4)
    cfg = Config(pipeline=PipelineConfig(max_batch=4))
    assert options_from_config(cfg).max_batch == 4


def test_the_golden_set_also_runs_from_as_many_concurrent_callers_as_serving_uses(tiny_bundle: Path) -> None:
    from dataclasses import replace

    from agent.proof import selftest

    calls: list[int] = []
    real = selftest.judge_concurrent

    def spy(opened, m, tensors, single, workers, bounds):  # the real check, counted
        calls.append(workers)
        return real(opened, m, tensors, single, workers, bounds)

    selftest.judge_concurrent = spy
    try:
        report = run_selftest(load_bundle(tiny_bundle), None, replace(_opts(2), workers=3))
    finally:
        selftest.judge_concurrent = real
    assert report.selected is not None and calls == [3]  # a healthy variant reproduces under 3 callers
    assert options_from_config(Config(pipeline=PipelineConfig(inference_workers=3))).workers == 3
