"""Reduced-scale JPEG decoding is proven, not assumed: the self-test checks the winning candidate on the
reduced path at 1/2, 1/4, 1/8, and `edge-agent run` decodes at no more than the scale it proved.

Every agent here is a real `edge-agent run` process on a real MJPEG video; every wait is bounded.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from agent.bundle.load import load_bundle
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.service.cli import render_selftest
from agent.service.controller import proven_decode
from agent.config import SourceConfig
from agentproc import AgentProcess, demo_config
from pipelines import run_to_end
from tests.conftest import TINY_SPEC

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"


def write_mjpeg(path: Path, frames: list[np.ndarray], fps: int = 30) -> Path:
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert writer.isOpened()
    for f in frames:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def demo_frames_at(h: int, w: int) -> list[np.ndarray]:
    """The demo's digit frames as a camera of h x w sees them (the bundle stretches to 128x128 anyway)."""
    frames = sorted((ROOT / "models" / "demo-frames" / "digits").glob("*.png"))[:24]
    return [cv2.resize(cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB), (w, h), interpolation=cv2.INTER_CUBIC)
            for p in frames]


def run_agent(tmp_path: Path, bundle: Path, source: dict, name: str) -> tuple[list[dict], list[dict]]:
    """`edge-agent run` until the video ends: (results, structured log events)."""
    cfg = demo_config(tmp_path / name, bundle=str(bundle), output={"health_interval_s": 0.2})
    cfg["source"] = source
    agent = AgentProcess(tmp_path / name, cfg)
    assert agent.run(240) == 0, agent.log_text()[-3000:]
    return agent.results(), agent.events()


def decoders_in_health(events: list[dict]) -> list[dict]:
    """The source's decoder stats (as health reports them) in each health event once the source has opened,
    and last in the shutdown event: a short video may end before the first periodic health."""
    return [e["decoder"] for e in events if e.get("event") in ("health", "shutdown")
            and (e.get("decoder") or {}).get("path")]


def test_selftest_proves_the_demo_classifier_at_every_reduced_scale(tmp_path: Path) -> None:
    report = run_selftest(load_bundle(DEMO), tmp_path, SelftestOptions(use_cache=False, latency_runs=5))
    assert report.selected is not None
    dec = report.to_dict()["decode"]
    assert dec["max_scale"] == 8 and report.decode_max_scale == 8
    assert [(s["scale"], s["passed"]) for s in dec["scales"]] == [(2, True), (4, True), (8, True)]
    assert dec["scales"][0]["fidelity"]["metrics"]["top1_agreement"] == 1.0
    assert "reduced JPEG decode: max scale 1/8 (1/2 ok, 1/4 ok, 1/8 ok)" in render_selftest(report.to_dict())


def test_1080p_mjpeg_is_served_at_reduced_scale_and_agrees_with_full_decode(tmp_path: Path) -> None:
    video = write_mjpeg(tmp_path / "digits-1080p.avi", demo_frames_at(1080, 1920))
    reduced, events = run_agent(tmp_path, DEMO, {"type": "video", "path": str(video)}, "auto")
    full, full_events = run_agent(tmp_path, DEMO, {"type": "video", "path": str(video), "decode_scale": 1}, "full")
    assert len(reduced) == len(full) == 24  # every frame of the video served, in both runs
    dec = decoders_in_health(events)[-1]
    assert (dec["path"], dec["codec"], dec["scale"]) == ("jpeg", "MJPG", 8)  # 240x135 still covers 128x128
    assert dec["limit"]["proven"] == 8
    assert decoders_in_health(full_events)[-1]["scale"] == 1
    top = lambda rs: [r["result"]["top"][0]["label"] for r in sorted(rs, key=lambda r: r["frame_index"])]  # noqa: E731
    assert top(reduced) == top(full)


RAW_SPEC = {**TINY_SPEC, "name": "tiny-raw-strict", "task": "raw",  # the tiny spec with raw outputs
            "postprocess": {"type": "raw", "outputs": ["logits"]},
            # an author who wants the logits to 80 dB: what JPEG's rounding on the reduced path cannot keep
            "selftest": {"fidelity": {"min_channel_snr_db": 80.0}}}


@pytest.fixture(scope="module")
def strict_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_classifier, structured_frames

    d = tmp_path_factory.mktemp("strict")
    np.savez_compressed(d / "calib.npz", raw=structured_frames(16, 40, 1))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(6, 40, 2))
    (d / "spec.yaml").write_text(yaml.safe_dump(RAW_SPEC))
    return create_bundle(CreateOptions(model=make_tiny_classifier(d / "tiny.onnx"), spec=d / "spec.yaml",
                                       calibration=d / "calib.npz", golden=d / "golden.npz", out=d / "bundle",
                                       int8=False))


def test_bundle_failing_its_golden_check_at_reduced_scale_is_served_at_full_scale(strict_bundle: Path,
                                                                                 tmp_path: Path) -> None:
    report = run_selftest(load_bundle(strict_bundle), tmp_path / "st", SelftestOptions(use_cache=False, latency_runs=5))
    assert report.selected is not None  # at full scale the candidate reproduces its references exactly
    dec = report.to_dict()["decode"]
    assert dec["max_scale"] == 1 and dec["scales"][0]["scale"] == 2 and not dec["scales"][0]["passed"]
    assert "worst channel SNR dB" in dec["reason"] and len(dec["scales"]) == 1  # stops at the first failure

    from agent.testing import structured_frames

    video = write_mjpeg(tmp_path / "strict-320.avi",
                        [cv2.resize(f, (320, 320), interpolation=cv2.INTER_CUBIC) for f in structured_frames(8, 40, 3)])
    # the config forces 1/4; the agent caps it at the proven 1/1 and says so in its log and health
    results, events = run_agent(tmp_path, strict_bundle, {"type": "video", "path": str(video), "decode_scale": 4},
                                "forced")
    assert len(results) == 8
    dec = decoders_in_health(events)[-1]
    assert dec["scale"] == 1 and dec["limit"]["proven"] == 1 and dec["limit"]["forced"] == 4
    assert "above the proven 1" in dec["limit"]["capped"]
    assert any(e.get("event") == "source.decode_scale_capped" for e in events)


def test_a_forced_decode_scale_is_never_above_the_proven_one() -> None:
    report = {"decode": {"max_scale": 2, "reason": "decode 1/4: fidelity: ..."}}
    cfg, limit = proven_decode(SourceConfig(type="video", decode_scale=8), report)
    assert cfg.decode_scale == 2 and limit["max_scale"] == 2 and limit["forced"] == 8
    cfg, limit = proven_decode(SourceConfig(type="video", decode_scale=1), report)
    assert cfg.decode_scale == 1 and "capped" not in limit
    _, limit = proven_decode(SourceConfig(type="video"), {"passed": True})  # a report without the check
    assert limit["max_scale"] == 1


def test_regions_of_a_frame_decoded_at_reduced_scale_are_in_camera_pixels(tmp_path: Path) -> None:
    """The pipeline maps geometry back with the frame's decode scale: regions found on a 1280x720 (1/4)
    and a 2560x1440 (1/8) JPEG land on the boxes drawn in the camera's pixels."""

    from agent.bundle.create import CreateOptions, create_bundle
    from agent.config import PipelineConfig
    from agent.proof.terms import SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.serving.sources import open_source
    from agent.testing import ListSink
    from tests.serving.test_map_model import FRAMES, SPEC, _frame, _write, make_map_model

    d = tmp_path / "map"
    d.mkdir()
    (d / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    _write(d / "calib", FRAMES, seed=10)
    _write(d / "golden", FRAMES, seed=20)
    bundle = load_bundle(create_bundle(CreateOptions(model=make_map_model(d / "map.onnx"), spec=d / "spec.yaml",
                                                     calibration=d / "calib", golden=d / "golden", out=d / "bundle",
                                                     int8=False, allow_unproven_decoder=True)))
    camera = [((720, 1280), [(200, 100, 700, 160), (800, 400, 1200, 600)]),
              ((1440, 2560), [(400, 200, 1400, 320)])]
    (tmp_path / "frames").mkdir()
    for i, ((h, w), boxes) in enumerate(camera):
        cv2.imwrite(str(tmp_path / "frames" / f"{i:03d}.jpg"), cv2.cvtColor(_frame(h, w, boxes, 40 + i), cv2.COLOR_RGB2BGR),
                    [cv2.IMWRITE_JPEG_QUALITY, 95])
    engine = build_engine(bundle, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())
    m = bundle.manifest
    source = open_source(SourceConfig(type="folder", path=tmp_path / "frames"), m.frame, m.preprocess.resize)
    sink = ListSink()
    run_to_end(source, engine, sink, PipelineConfig(), True)
    assert source.stats.decoder["scale"] == 8  # the last frame, 2560x1440, decoded at 320x180
    assert len(sink.results) == 2
    for r, (_, boxes) in zip(sink.results, camera):
        got = sorted(reg["box"] for reg in r["result"]["regions"])
        assert len(got) == len(boxes), got
        for g, want in zip(got, sorted(boxes)):
            assert np.allclose(g, want, atol=2 * 2560 / 320), (g, want)  # two model pixels, in camera pixels


def test_a_cached_verdict_keeps_the_proven_decode_scale(tmp_path: Path) -> None:
    bundle = load_bundle(DEMO)
    first = run_selftest(bundle, tmp_path, SelftestOptions(latency_runs=5))
    again = run_selftest(bundle, tmp_path, SelftestOptions(latency_runs=5))
    assert again.cached and again.decode_max_scale == first.decode_max_scale == 8
    assert again.to_dict()["decode"] == first.to_dict()["decode"]
