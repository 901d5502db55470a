"""The real provider matrix: run by scripts/test.sh inside venvs with onnxruntime-openvino and
onnxruntime-gpu (each replaces the `onnxruntime` module). In the plain CPU venv these skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from agent.bundle.load import load_bundle
from agent.config import Config, ProvidersConfig, SelectionConfig
from agent.proof.probe import probe_provider
from agent.proof.terms import CUDA, OPENVINO, TENSORRT
from agent.proof.selftest import options_from_config, run_selftest
from agent.proof.terms import CPU

LISTED = set(ort.get_available_providers())
openvino = pytest.mark.skipif(OPENVINO not in LISTED, reason="needs onnxruntime-openvino (scripts/test.sh runs it)")
gpu_build = pytest.mark.skipif(CUDA not in LISTED, reason="needs onnxruntime-gpu (scripts/test.sh runs it)")


@openvino
def test_openvino_cpu_is_usable_and_takes_the_probe_nodes() -> None:
    s = probe_provider(OPENVINO, {"device_type": "CPU"})
    assert s.usable, s.reason
    assert s.nodes_on_provider == s.total_nodes > 0


@openvino
def test_selftest_selects_openvino_for_real_with_nodes_placed_on_it(tiny_bundle: Path, tmp_path: Path) -> None:
    cfg = Config(state_dir=tmp_path, providers=ProvidersConfig(order=(OPENVINO, CPU), options={OPENVINO: {"device_type": "CPU"}}))
    report = run_selftest(load_bundle(tiny_bundle), tmp_path, options_from_config(cfg))
    assert report.selected is not None
    assert report.selected.candidate.provider == OPENVINO
    placement = report.selected.evidence.placement
    assert placement.fraction(OPENVINO) >= 0.9, placement


@openvino
def test_the_serving_session_opens_the_proven_candidate_with_the_childs_compile_cache(tiny_bundle: Path, tmp_path: Path) -> None:
    """Issue 13: the child proves, the serving process opens only the proven candidate, pointed at the
    same provider compile cache under the state dir (TensorRT engines, OpenVINO blobs). Measured with
    this ORT build, OpenVINO on CPU rewrites its blob on every session and gains nothing: the test pins
    that both processes share the cache, not a speed-up."""
    from agent.serving.engine import build_engine

    cfg = Config(state_dir=tmp_path, providers=ProvidersConfig(order=(OPENVINO, CPU), options={OPENVINO: {"device_type": "CPU"}}))
    report = run_selftest(load_bundle(tiny_bundle), tmp_path, options_from_config(cfg))
    cand = report.selected.candidate
    assert cand.provider == OPENVINO and cand.options["cache_dir"] == str(tmp_path / "cache" / "openvino")
    assert sorted((tmp_path / "cache" / "openvino").glob("*.blob")), "the self-test wrote nothing to the cache"
    engine = build_engine(load_bundle(tiny_bundle), cand, cfg.session)
    assert engine.opened.effective[0] == OPENVINO


@openvino
def test_openvino_gpu_on_a_machine_without_one_is_a_silent_fallback_and_cpu_is_selected(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    s = probe_provider(OPENVINO, {"device_type": "GPU"})
    assert not s.usable
    assert s.reason.startswith("silent fallback") and "GPU" in s.reason
    cfg = Config(state_dir=tmp_path, providers=ProvidersConfig(order=(OPENVINO, CPU), options={OPENVINO: {"device_type": "GPU"}}))
    report = run_selftest(load_bundle(tiny_bundle), tmp_path, options_from_config(cfg))
    assert report.selected.candidate.provider == CPU
    assert all(r.candidate.provider != OPENVINO for r in report.results)


@gpu_build
@pytest.mark.parametrize("name", [CUDA, TENSORRT])
def test_listed_gpu_providers_without_a_gpu_are_rejected_with_the_loader_reason(name: str) -> None:
    assert name in LISTED
    s = probe_provider(name)
    assert s.listed and not s.usable
    assert s.reason.startswith("silent fallback") or s.reason.startswith("session creation failed")
    assert any(w in s.reason for w in ("Failed to load library", "cannot open shared object", "CUDA", "TensorRT")), s.reason


@gpu_build
def test_gpu_build_selects_cpu_and_never_reports_cuda(tiny_bundle: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle", str(tiny_bundle),
         "--state-dir", str(tmp_path), "--json", "--latency-runs", "10"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # ORT's "EP Error ... Falling back" print must not corrupt the JSON
    assert doc["selected"]["provider"] == CPU
    assert doc["selected"]["effective_providers"] == [CPU]
    for c in doc["candidates"]:
        assert CUDA not in (c.get("effective_providers") or [])
    cuda = next(p for p in doc["providers"] if p["name"] == CUDA)
    assert cuda["listed"] and not cuda["usable"]


@gpu_build
def test_gpu_build_with_cpu_fallback_forbidden_refuses_to_serve(tiny_bundle: Path, tmp_path: Path) -> None:
    cfg = Config(selection=SelectionConfig(allow_cpu_fallback=False))
    report = run_selftest(load_bundle(tiny_bundle), tmp_path, options_from_config(cfg))
    assert report.selected is None
    assert "no candidate to try" in report.reason
    assert any(CUDA in n and "not usable" in n for n in report.notes)
