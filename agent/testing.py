"""Helpers for testing bundles and the agent: tiny real models and manifest rewrites with fresh hashes.

Shipped so users can test their own bundles the way our tests do. Needs `onnx` (the build or test extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from agent.bundle.load import hash_files
from agent.vocabulary.manifest import MANIFEST_NAME, SIGNATURE_NAME


def _save_checked(graph: Any, path: Path, opset: int) -> Path:
    """Wrap a graph in a model (IR 8, so older ORT builds load it too), check it, save it."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def make_tiny_classifier(path: Path, classes: int = 4, size: int = 32, seed: int = 0, opset: int = 17) -> Path:
    """A small real CNN (Conv-Relu-Conv-Relu-GAP-Gemm) with dynamic batch, saved at `path`."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32), "w2"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b2"),
        numpy_helper.from_array((rng.standard_normal((classes, 16)) * 1.5).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits,
    )
    return _save_checked(graph, path, opset)


def structured_frames(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    """Frames with shapes and colours (not white noise), so a CNN's outputs differ between frames."""
    import cv2

    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        img = np.full((size, size, 3), rng.integers(0, 255, 3), np.uint8)
        for _ in range(3):
            color = tuple(int(c) for c in rng.integers(0, 255, 3))
            p1 = tuple(int(v) for v in rng.integers(0, size, 2))
            p2 = tuple(int(v) for v in rng.integers(0, size, 2))
            cv2.rectangle(img, p1, p2, color, -1) if rng.random() < 0.5 else cv2.circle(img, p1, int(rng.integers(2, size // 2)), color, -1)
        out[i] = img
    return out


def rewrite_manifest(root: Path, mutate: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Apply `mutate` to bundle.yaml's data and recompute every file's sha256 (drops any signature).

    This is what an attacker or a careless build could do; the self-test, not the hashes, must catch it.
    """
    root = Path(root)
    path = root / MANIFEST_NAME
    data = yaml.safe_load(path.read_text())
    if mutate:
        mutate(data)
    data["files"] = hash_files(root)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=120))
    (root / SIGNATURE_NAME).unlink(missing_ok=True)


def scale_initializer(model_path: Path, name: str, factor: float) -> None:
    """Tamper with one weight tensor in place (for tests that must see parity fail)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    for i, init in enumerate(model.graph.initializer):
        if init.name == name:
            arr = numpy_helper.to_array(init) * factor
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr.astype(np.float32), name))
            onnx.save(model, str(model_path))
            return
    raise KeyError(f"{model_path}: no initializer {name!r}")


def make_tiny_sensor_model(path: Path, window: int = 64, channels: int = 3, classes: int = 3, seed: int = 0) -> Path:
    """A small real 1-D CNN over (batch, channels, window) sensor windows."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, channels, 5)) * 0.5).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((classes, 8)) * 1.5).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["window", "w1", "b1"], ["c"], name="conv", pads=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["scores"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_sensor",
        [helper.make_tensor_value_info("window", TensorProto.FLOAT, ["batch", channels, window])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits,
    )
    return _save_checked(graph, path, 17)


class ListSink:
    """Collects results in memory (thread-safe append), for tests of the pipeline."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.closed = False

    def write(self, result: dict[str, Any]) -> None:
        self.results.append(result)

    def close(self) -> None:
        self.closed = True
