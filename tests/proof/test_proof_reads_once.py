"""Cold start (issue 24 item 4): a proof reads each golden sample file once; the variants' recorded outputs
come from the samples already loaded, not from a second and third read of every file. A cold boot reads each
golden array once, in the self-test child: the child's load checks them and keeps them for its proof (it read
all of them twice), and the agent, after the verdict, only hashes the files the child checked (it read all of
them a third time, 25 ms of the demo's cold start, on the critical path)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from agent.bundle import load as load_mod
from agent.bundle.load import load_bundle
from agent.config import Config
from agent.proof import selftest
from agent.service import boot as boot_mod
from agent.service import selftest_child

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


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


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real = load_mod.load_golden

    def load_golden(root, rel, index, manifest):  # the real reader, each read noted
        reads.append(rel)
        return real(root, rel, index, manifest)

    monkeypatch.setattr(load_mod, "load_golden", load_golden)
    return reads


def test_the_agent_reads_no_golden_array_at_boot_and_still_serves(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _counted(monkeypatch)  # this process only: the proof runs in its child
    outcome = boot_mod.boot(Config(state_dir=tmp_path / "state", bundle=DEMO), None)
    assert outcome.engine is not None, outcome.reason
    assert reads == []
    # the serving audit still reads them, one at a time, from the same bundle
    assert len(list(outcome.bundle.golden_samples())) == len(outcome.bundle.manifest.golden) == len(reads)


def test_the_self_test_child_reads_each_golden_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = {name: getattr(selftest, name) for name in ("detect_providers", "prove", "evaluate")}
    reads = _counted(monkeypatch)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO)}))
    out = tmp_path / "report.json"
    rc = selftest_child.main(["--bundle", str(DEMO), "--state-dir", str(tmp_path / "state"), "--out", str(out),
                              "--config", str(cfg), "--no-cache"])
    assert rc == 0
    # the child passes its hooks as values (selftest.Seams): the module's own steps are left as they were
    assert {name: getattr(selftest, name) for name in steps} == steps
    golden = yaml.safe_load((DEMO / "bundle.yaml").read_text())["golden"]
    assert sorted(reads) == sorted(golden), reads
