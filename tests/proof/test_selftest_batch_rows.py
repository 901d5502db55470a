"""Every row of every proven batch is judged. With fewer golden samples than the micro-batch (16
samples, batches of 32 on a GPU), a batch filled round-robin repeats samples, and only each sample's
first row was judged: a batched kernel wrong only in rows past the golden count passed as proven."""

from __future__ import annotations

from pathlib import Path

from agent.bundle.load import load_bundle
from agent.proof.selftest import run_selftest
from agent.testing import rewrite_manifest
from batch_faults import batch_opts, wrong_from_row


def test_a_variant_wrong_only_in_rows_past_the_golden_count_is_rejected(tiny_bundle: Path) -> None:
    n = len(load_bundle(tiny_bundle).golden())
    wrong_from_row(tiny_bundle / "model_int8.onnx", n)
    rewrite_manifest(tiny_bundle)
    bundle = load_bundle(tiny_bundle)
    assert run_selftest(bundle, None, batch_opts(n)).selected is not None  # no batch of n rows reaches row n
    report = run_selftest(bundle, None, batch_opts(n + 1))  # serving's batch of n+1 frames: row n is wrong
    assert report.selected is None, f"served with row {n} of a batch of {n + 1} wrong"
    int8 = next(r for r in report.results if r.candidate.variant == "int8")
    found = [f for f in int8.findings if f.check == "reproduction"]
    assert found and found[0].stage == f"batch {n + 1}", int8.reasons
