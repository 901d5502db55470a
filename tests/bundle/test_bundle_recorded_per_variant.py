"""One variant's recorded outputs stripped from EVERY golden sample (the other variant keeps its own)
used to pass verification: that variant's reproduction fell back to the source's references (top-1
decisions for a classifier), so the demo INT8 with a Conv weight x1.5 was served again."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.errors import BundleError
from agent.testing import rewrite_manifest

ROOT = Path(__file__).resolve().parents[2]


def _strip(npz: Path, prefix: str) -> None:
    with np.load(npz, allow_pickle=False) as z:
        keep = {k: z[k] for k in z.files if not k.startswith(prefix)}
    np.savez_compressed(npz, **keep)
    if npz.suffix != ".npz":
        npz.with_name(npz.name + ".npz").replace(npz)


def test_one_variant_stripped_from_every_sample_fails_verification(tiny_bundle: Path) -> None:
    for sample in (tiny_bundle / "golden").glob("*.npz"):
        _strip(sample, "variant.int8.")
    rewrite_manifest(tiny_bundle)  # hashes right again: only the content is short
    with pytest.raises(BundleError) as err:
        load_bundle(tiny_bundle)
    msg = str(err.value)
    assert "variant.int8." in msg and "fp32" in msg and "bundle create" in msg


def test_the_demo_int8_x1_5_stripped_of_its_recorded_outputs_is_never_served(tmp_path: Path) -> None:
    import onnx

    from agent.proof.selection import SelectionPolicy
    from agent.proof.selftest import SelftestOptions, run_selftest
    from agent.testing import scale_initializer

    bundle = tmp_path / "digits"
    shutil.copytree(ROOT / "models" / "digits-classifier", bundle)
    model = onnx.load(str(bundle / "model_int8.onnx"))
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    scale = next(n.input[1] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == conv.input[1])
    scale_initializer(bundle / "model_int8.onnx", scale, 1.5)
    for sample in (bundle / "golden").glob("*.npz"):
        _strip(sample, "variant.int8.")
    rewrite_manifest(bundle)
    try:
        loaded = load_bundle(bundle)
    except BundleError:
        return  # refused at verification: nothing of it serves
    report = run_selftest(loaded, None, SelftestOptions(
        policy=SelectionPolicy(variant="int8"), use_cache=False, latency_runs=5, provider_order=("CPUExecutionProvider",)))
    assert report.selected is None, f"the int8 with a Conv weight x1.5 was served: {report.selected}"
