"""The `edge-agent` command line, run as a user would: a real process, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path



def edge_agent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands() -> None:
    out = edge_agent("--help")
    assert out.returncode == 0
    for cmd in ("bundle", "providers", "selftest", "config"):
        assert cmd in out.stdout


def test_demo_bundle_verifies_and_inspects(demo_bundle: Path) -> None:
    out = edge_agent("bundle", "verify", str(demo_bundle))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK digits-classifier@")
    out = edge_agent("bundle", "inspect", str(demo_bundle))
    assert out.returncode == 0 and "int8" in out.stdout and "Conv" in out.stdout
    doc = json.loads(edge_agent("bundle", "inspect", "--json", str(demo_bundle)).stdout)
    q = {v["name"]: v["quality"] for v in doc["variants"]}
    # the bar: INT8 held-out top-1 within 1.0 point of FP32
    assert q["fp32"]["heldout_top1"] - q["int8"]["heldout_top1"] <= 0.01


def test_demo_selftest_json_selects_a_cpu_candidate_with_evidence(demo_bundle: Path, tmp_path: Path) -> None:
    out = edge_agent("selftest", "--bundle", str(demo_bundle), "--json", "--state-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["selected"]["provider"] == "CPUExecutionProvider"
    tested = [c for c in doc["candidates"] if c["status"] == "tested"]
    assert tested and all(c["placement"] and c["parity"] and c["latency"] for c in tested)
    assert json.loads((tmp_path / "selftest" / "report.json").read_text())["cache_key"] == doc["cache_key"]


def test_selftest_that_selects_nothing_exits_3_with_a_one_line_reason(tiny_bundle: Path, tmp_path: Path) -> None:
    from agent.testing import rewrite_manifest

    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(latency_budget_ms={"default": 0.0001}))
    out = edge_agent("selftest", "--bundle", str(tiny_bundle), "--state-dir", str(tmp_path), "--latency-retries", "0")
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1].startswith("edge-agent: no candidate passed: ")


def test_pinning_an_unusable_provider_is_a_clear_error(tiny_bundle: Path, tmp_path: Path) -> None:
    out = edge_agent("selftest", "--bundle", str(tiny_bundle), "--state-dir", str(tmp_path),
                     "--provider", "CUDAExecutionProvider")
    assert out.returncode == 1
    assert "CUDAExecutionProvider is not usable on this device" in out.stderr


def test_pack_unpack_and_verify_a_tarball(tiny_bundle: Path, tmp_path: Path) -> None:
    tgz = tmp_path / "b.tar.gz"
    assert edge_agent("bundle", "pack", str(tiny_bundle), str(tgz)).returncode == 0
    assert edge_agent("bundle", "verify", str(tgz)).returncode == 0
    out = edge_agent("bundle", "unpack", str(tgz), str(tmp_path / "u"))
    assert out.returncode == 0 and (tmp_path / "u" / "bundle.yaml").exists()


def test_verify_of_a_corrupt_bundle_exits_1_naming_the_file(tiny_bundle: Path) -> None:
    (tiny_bundle / "model_fp32.onnx").write_bytes(b"junk")
    out = edge_agent("bundle", "verify", str(tiny_bundle))
    assert out.returncode == 1
    assert "model_fp32.onnx: hash mismatch" in out.stderr


def test_providers_json_reports_cpu_usable() -> None:
    out = edge_agent("providers", "--json")
    statuses = {s["name"]: s for s in json.loads(out.stdout)}
    assert statuses["CPUExecutionProvider"]["usable"] is True
    assert statuses["CPUExecutionProvider"]["nodes_on_provider"] > 0


def test_config_check_prints_effective_settings_or_names_the_bad_key(tmp_path: Path) -> None:
    good = tmp_path / "a.yaml"
    good.write_text("device_id: d1\n")
    out = edge_agent("config", "check", str(good))
    assert out.returncode == 0 and json.loads(out.stdout)["device_id"] == "d1"
    bad = tmp_path / "b.yaml"
    bad.write_text("devce_id: d1\n")
    out = edge_agent("config", "check", str(bad))
    assert out.returncode == 1 and "b.yaml: key devce_id: unknown key" in out.stderr
