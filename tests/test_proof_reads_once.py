"""Cold start (issue 24 item 4): a proof reads each golden sample file once; the variants' recorded outputs
come from the samples already loaded, not from a second and third read of every file."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.proof import selftest

DEMO = Path(__file__).resolve().parents[1] / "models" / "digits-classifier"


def test_recorded_outputs_from_the_loaded_samples_are_the_files_arrays() -> None:
    bundle = load_bundle(DEMO)
    golden = bundle.golden()
    for v in bundle.manifest.variants:
        from_files = selftest.recorded_outputs(bundle, v.name)
        loaded = selftest.recorded_outputs(bundle, v.name, golden)
        assert from_files is not None and loaded is not None and len(loaded) == len(from_files) == len(golden)
        for a, b in zip(from_files, loaded):
            assert set(a) == set(b) == set(bundle.manifest.output_names)
            assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    assert selftest.recorded_outputs(bundle, "no-such-variant", golden) is None
    assert selftest.recorded_outputs(bundle, "no-such-variant") is None


def test_a_cold_proof_opens_each_golden_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = load_bundle(DEMO)
    opened: collections.Counter[str] = collections.Counter()
    real_load = np.load

    def counting_load(file: Any, *a: Any, **kw: Any) -> Any:
        opened[str(file)] += 1
        return real_load(file, *a, **kw)

    monkeypatch.setattr(np, "load", counting_load)
    report = selftest.run_selftest(bundle, tmp_path, selftest.SelftestOptions(skip_reduced_decode="not this test's"))
    assert report.selected is not None and not report.cached
    golden = {str(bundle.path(rel)) for rel in bundle.manifest.golden}
    assert set(opened) == golden and set(opened.values()) == {1}, opened
