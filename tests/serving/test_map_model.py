"""A dynamic-size probability-map model (DBNet-like): fit_multiple preprocessing, regions in frame pixels,
results under 64 KB, frames of different sizes never batched together, and a self-test per sample."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from agent.bundle.create import CreateOptions, create_bundle
from agent.bundle.load import load_bundle
from agent.config import PipelineConfig, SourceConfig
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.serving.sources import is_lossless, open_source
from agent.vocabulary.decoders import result_bytes
from agent.testing import ListSink
from pipelines import run_to_end

SPEC = {
    "name": "tiny-map", "version": 1, "label": "0.1.0", "task": "segmentation",
    "frame": {"kind": "image", "height": 480, "width": 640, "channels": 3, "color": "rgb"},
    "preprocess": {"resize": {"mode": "fit_multiple", "limit_side": 320, "limit_type": "max", "multiple": 32},
                   "scale": 0.00392156862745098, "layout": "nchw", "dtype": "float32"},
    "postprocess": {"type": "segmentation", "output": "maps", "threshold": 0.5, "min_area": 8, "max_regions": 50},
}


def make_map_model(path: Path) -> Path:
    """maps = sigmoid(20 * (mean over channels - 0.5)), any H x W: bright areas are 'text'."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.full((1, 3, 1, 1), 20 / 3, np.float32), "w"),
             numpy_helper.from_array(np.array([-10.0], np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], name="score"),
             helper.make_node("Sigmoid", ["z"], ["maps"], name="prob")]
    graph = helper.make_graph(nodes, "tiny_map",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
                              [helper.make_tensor_value_info("maps", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _frame(h: int, w: int, boxes: list[tuple[int, int, int, int]], seed: int) -> np.ndarray:
    img = np.random.default_rng(seed).integers(0, 60, (h, w, 3), dtype=np.uint8)
    for x1, y1, x2, y2 in boxes:
        img[y1:y2, x1:x2] = 230
    return img


FRAMES = [
    ((480, 640), [(100, 50, 300, 90), (400, 300, 600, 330)]),
    ((720, 1280), [(200, 100, 700, 160)]),
    ((300, 500), [(20, 20, 120, 60)]),
]


def _write(folder: Path, frames: list, seed: int = 0) -> None:
    folder.mkdir(parents=True)
    for i, ((h, w), boxes) in enumerate(frames):
        cv2.imwrite(str(folder / f"{i:03d}.png"), cv2.cvtColor(_frame(h, w, boxes, seed + i), cv2.COLOR_RGB2BGR))


@pytest.fixture(scope="module")
def map_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("map")
    model = make_map_model(d / "map.onnx")
    (d / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    _write(d / "calib", FRAMES * 2, seed=10)
    _write(d / "golden", FRAMES, seed=20)
    return create_bundle(CreateOptions(model=model, spec=d / "spec.yaml", calibration=d / "calib",
                                       golden=d / "golden", out=d / "bundle", min_agreement=0.5,
                                       allow_unproven_decoder=True))  # a synthetic map: no package to answer


def test_golden_samples_of_a_dynamic_size_model_keep_their_own_shapes(map_bundle: Path) -> None:
    b = load_bundle(map_bundle)
    assert b.manifest.input.shape == ("batch", 3, "h", "w")
    assert [g.input.shape for g in b.golden()] == [(1, 3, 256, 320), (1, 3, 192, 320), (1, 3, 192, 320)]


def test_map_model_serves_regions_in_frame_pixels_under_64_kb_without_mixing_sizes_in_a_batch(
        map_bundle: Path, tmp_path: Path) -> None:
    b = load_bundle(map_bundle)
    engine = build_engine(b, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())
    assert not engine.dynamic_batch  # each frame has its own input size
    _write(tmp_path / "frames", FRAMES, seed=30)
    cfg = SourceConfig(type="folder", path=tmp_path / "frames")
    source = open_source(cfg, b.manifest.frame)
    sink = ListSink()
    p = run_to_end(source, engine, sink, PipelineConfig(max_batch=4, batch_timeout_ms=50), is_lossless(cfg, source))
    assert len(sink.results) == len(FRAMES) and p.metrics.bad_frames == 0 and p.metrics.inference_errors == 0
    for r, (_, boxes) in zip(sink.results, FRAMES):
        assert r["batch"] == 1 and result_bytes(r["result"]) < 64 * 1024
        got = sorted(reg["box"] for reg in r["result"]["regions"])
        assert len(got) == len(boxes)
        for g, want in zip(got, sorted(boxes)):
            # a region found on the resized map maps back to within a few frame pixels of the drawn box
            assert np.allclose(g, want, atol=6), (g, want)


def test_selftest_runs_a_dynamic_size_model_sample_by_sample(map_bundle: Path, tmp_path: Path) -> None:
    from agent.proof.selftest import SelftestOptions, run_selftest

    report = run_selftest(load_bundle(map_bundle), tmp_path, SelftestOptions(latency_runs=5))
    fp32 = next(r for r in report.results if r.candidate.variant == "fp32")
    assert fp32.passed, fp32.reasons
