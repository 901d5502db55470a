"""Recorded variant outputs are what reproduction judges: a golden sample stripped of them fails the
bundle's verification (it used to turn reproduction off for every sample), and every committed demo
bundle carries them for every variant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.errors import BundleError
from agent.testing import rewrite_manifest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted(p.parent for p in (ROOT / "models").glob("*/bundle.yaml"))


def _strip(npz: Path, prefix: str) -> None:
    with np.load(npz, allow_pickle=False) as z:
        keep = {k: z[k] for k in z.files if not k.startswith(prefix)}
    np.savez_compressed(npz, **keep)
    if npz.suffix != ".npz":  # np.savez appends .npz to a name without it
        npz.with_name(npz.name + ".npz").replace(npz)


def test_a_golden_sample_stripped_of_recorded_outputs_fails_verification(tiny_bundle: Path) -> None:
    load_bundle(tiny_bundle)  # as built: every sample carries every variant's outputs
    sample = sorted((tiny_bundle / "golden").glob("*.npz"))[3]
    _strip(sample, "variant.int8.")
    rewrite_manifest(tiny_bundle)  # the hashes are right again: only the content is short
    with pytest.raises(BundleError) as err:
        load_bundle(tiny_bundle)
    msg = str(err.value)
    assert sample.name in msg and "variant.int8." in msg and "bundle create" in msg


def test_a_bundle_with_no_recorded_outputs_at_all_still_loads(tiny_bundle: Path) -> None:
    for sample in (tiny_bundle / "golden").glob("*.npz"):
        _strip(sample, "variant.")
    rewrite_manifest(tiny_bundle)
    assert load_bundle(tiny_bundle).golden()[0].variant_outputs == {}


@pytest.mark.parametrize("root", COMMITTED, ids=[p.name for p in COMMITTED])
def test_every_committed_bundle_carries_recorded_outputs_for_every_variant(root: Path) -> None:
    bundle = load_bundle(root, check_contracts=False)
    m = bundle.manifest
    for g in bundle.golden():
        for v in m.variants:
            have = sorted(g.variant_outputs.get(v.name, {}))
            assert have == sorted(m.output_names), (
                f"{root / g.file}: variant {v.name} has recorded outputs {have}, not {list(m.output_names)}: "
                "rebuild with scripts/demo_rebundle.py (today's `bundle create`)")


def test_the_rebuilt_demo_int8_with_a_conv_weight_x1_5_is_rejected_on_reproduction(tmp_path: Path) -> None:
    """The old demo bundle judged its INT8 on 16 top-1 decisions only, and served this one."""
    import shutil

    import onnx

    from agent.proof.selection import SelectionPolicy
    from agent.proof.selftest import SelftestOptions, run_selftest
    from agent.testing import scale_initializer

    bundle = tmp_path / "digits"
    shutil.copytree(ROOT / "models" / "digits-classifier", bundle)
    model = onnx.load(str(bundle / "model_int8.onnx"))
    conv = next(n for n in model.graph.node if n.op_type == "Conv")  # the first convolution's weights
    scale = next(n.input[1] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == conv.input[1])
    scale_initializer(bundle / "model_int8.onnx", scale, 1.5)
    rewrite_manifest(bundle)
    report = run_selftest(load_bundle(bundle), None, SelftestOptions(
        policy=SelectionPolicy(variant="int8"), use_cache=False, latency_runs=5, provider_order=("CPUExecutionProvider",)))
    assert report.selected is None
    int8 = next(r for r in report.results if r.candidate.variant == "int8")
    assert any(f.check == "reproduction" for f in int8.findings), int8.reasons


def test_a_boot_that_serves_another_candidate_of_the_same_bundle_says_its_answers_changed(tmp_path: Path) -> None:
    from agent.link.health import health_selftest
    from agent.service.boot import note_served

    bundle = load_bundle(ROOT / "models" / "digits-classifier", check_contracts=False)
    first: dict = {"passed": True}
    note_served(tmp_path, bundle, "CPUExecutionProvider:int8", first)
    again: dict = {"passed": True}
    note_served(tmp_path, bundle, "CPUExecutionProvider:int8", again)
    assert "served_changed" not in first and "served_changed" not in again
    changed: dict = {"passed": True}
    note_served(tmp_path, bundle, "CPUExecutionProvider:fp32", changed)
    assert changed["served_changed"]["previous"] == "CPUExecutionProvider:int8"
    assert health_selftest(changed)["served_changed"]["now"] == "CPUExecutionProvider:fp32"
