"""Faults found at the seams between the controller (issue 13), the outer surface (issue 12) and the
report/metrics (issue 14), each pinned by a test named after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent.hashing import sha256_file
from agent.report.sources import load_report


def _report(version: int, sha: str, path: Path, created: str, p95: float) -> dict:
    return {"schema": 1, "created": created, "passed": True, "reason": None,
            "bundle": {"name": "tiny-classifier", "version": version, "manifest_sha256": sha, "path": str(path)},
            "selected": {"provider": "CPUExecutionProvider", "variant": "fp32", "precision": "fp32"},
            "candidates": [{"provider": "CPUExecutionProvider", "variant": "fp32", "verdict": "pass",
                            "latency": {"p95_ms": p95}}]}


def test_report_from_a_state_dir_after_an_update_shows_the_serving_bundles_selftest_not_the_boots(
        tmp_path: Path, tiny_bundle_master: Path) -> None:
    """An update's proof runs in <state>/update-selftest (the controller), and the served self-test doc
    (health, /metrics, the retained topic) becomes that report; `edge-agent report <state>` read only
    <state>/selftest/report.json, the boot's report of the bundle the update replaced."""
    state = tmp_path / "state"
    v1, v2 = state / "store" / "bundles" / "v1", state / "store" / "bundles" / "v2"
    shutil.copytree(tiny_bundle_master, v1)
    shutil.copytree(tiny_bundle_master, v2)
    with open(v2 / "bundle.yaml", "a") as f:
        f.write("# v2\n")
    (state / "store" / "current").symlink_to("bundles/v2")
    boot = _report(1, sha256_file(v1 / "bundle.yaml"), v1, "2026-01-01T00:00:00+00:00", 1.0)
    upd = _report(2, sha256_file(v2 / "bundle.yaml"), state / "store" / "staging" / "update-x" / "bundle",
                  "2026-01-01T00:01:00+00:00", 2.0)
    for p, doc in ((state / "selftest" / "report.json", boot),
                   (state / "update-selftest" / "selftest" / "report.json", upd)):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc))

    got = load_report(state)
    assert got["bundle"]["version"] == 2 and got["created"] == upd["created"]
    # the staging path the update was proven in is gone: the page finds the bundle where it now lives
    assert Path(got["bundle"]["path"]).resolve() == v2.resolve()

    # after a rollback to v1, re-proven in update-selftest: the newer v1 report is the one that serves
    (state / "store" / "current").unlink()
    (state / "store" / "current").symlink_to("bundles/v1")
    rb = _report(1, sha256_file(v1 / "bundle.yaml"), v1, "2026-01-01T00:02:00+00:00", 3.0)
    (state / "update-selftest" / "selftest" / "report.json").write_text(json.dumps(rb))
    assert load_report(state)["created"] == rb["created"]

    # no store (updates off): the boot's report, as before
    shutil.rmtree(state / "store")
    assert load_report(state)["created"] == boot["created"]
