"""scripts/yolo_resize.py: the YOLOv8 head's grid constants recomputed for another input size.

The grid tests are pure; the surgery tests use the real-model cache's layout model (AGPL-3.0, fetched by
scripts/real_models.py, never committed) and skip without it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("yolo_resize", ROOT / "scripts" / "yolo_resize.py")
yolo_resize = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("yolo_resize", yolo_resize)
_spec.loader.exec_module(yolo_resize)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
_skip_without_layout = pytest.mark.skipif(
    not (yolo_resize.SOURCE.exists() and (yolo_resize.LAYOUT / "golden.npz").exists()),
    reason="no cached layout model: python scripts/real_models.py fetch layout && "
           "python scripts/real_models.py references layout")


def needs_layout(test):  # noqa: ANN001, ANN201 - a pytest decorator
    """The cached layout model and its references (`real`: scripts/test.sh runs it once they are made)."""
    return pytest.mark.real(_skip_without_layout(test))


def test_anchor_grid_is_cell_centres_x_fastest_per_stride_level():
    points, strides = yolo_resize.head_constants(64)
    assert yolo_resize.anchor_count(64) == 64 + 16 + 4 == points.shape[2] == strides.shape[1]
    assert points[0, :, :3].T.tolist() == [[0.5, 0.5], [1.5, 0.5], [2.5, 0.5]]
    assert points[0, :, 8].tolist() == [0.5, 1.5]  # the second row of the stride-8 grid
    assert points[0, :, 64].tolist() == [0.5, 0.5] and points[0, :, 83].tolist() == [1.5, 1.5]
    assert np.unique(strides, return_counts=True)[1].tolist() == [64, 16, 4]


@pytest.fixture(scope="module")
def layout():
    return onnx.load(str(yolo_resize.SOURCE))


def _run(model, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@needs_layout
def test_resized_at_the_original_size_reproduces_the_original_output_exactly(layout):
    with np.load(yolo_resize.LAYOUT / "golden.npz") as z:
        x = z["input"][:1].astype(np.float32)
    same, changed = yolo_resize.resize_model(layout, 1024)
    assert changed == {"anchor_points": 2, "strides": 1, "reshape_shapes": 2}
    assert np.array_equal(_run(same, x), _run(layout, x))


@needs_layout
def test_resized_to_320_runs_with_the_320_grid(layout):
    small, _ = yolo_resize.resize_model(layout, 320)
    out = _run(small, np.full((1, 3, 320, 320), 114 / 255, dtype=np.float32))
    assert out.shape == (1, 15, 40 * 40 + 20 * 20 + 10 * 10)
    assert [d.dim_value for d in layout.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 1024, 1024]  # not mutated


@needs_layout
def test_an_input_side_not_a_multiple_of_32_is_refused(layout):
    with pytest.raises(SystemExit, match="multiple of 32"):
        yolo_resize.resize_model(layout, 300)


@needs_layout
def test_a_baked_anchor_grid_other_than_the_computed_one_is_refused_by_name(layout):
    from onnx import numpy_helper

    bad = onnx.ModelProto()
    bad.CopyFrom(layout)
    init = next(i for i in bad.graph.initializer if numpy_helper.to_array(i).shape == (1, 2, 21504))
    arr = numpy_helper.to_array(init).copy()
    arr[0, 0, 5] += 1.0
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    with pytest.raises(SystemExit, match=f"{init.name}: .*not the anchor grid"):
        yolo_resize.resize_model(bad, 320)
