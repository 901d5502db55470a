"""Small pre and post ONNX graphs built with onnx.helper for the stage tests (the names of issue 21's interface:
pre input `frame`, outputs the model input and `geometry`; post inputs model outputs, `frame_size`, `geometry`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _save(nodes: list, inputs: list, outputs: list, path: Path, name: str) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def stretch_pre(path: Path, output: str, width: int, height: int, scale: float = 1.0,
                mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,), channels: int = 3) -> Path:
    """frame uint8 [H, W, C] (any size) -> NCHW float32 [1, C, height, width]: bilinear stretch (half-pixel
    centres, as OpenCV's INTER_LINEAR), rounded to uint8 values as OpenCV's uint8 resize does, then
    (x * scale - mean) / std per channel; `geometry` = [width / W, height / H, 0, 0, 0, 0]."""
    mul = (np.float32(scale) / np.asarray(std, np.float32)).reshape(1, -1, 1, 1).astype(np.float32)
    sub = (np.asarray(mean, np.float32) / np.asarray(std, np.float32)).reshape(1, -1, 1, 1).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["frame"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["chw"], perm=[2, 0, 1]),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["chw", "axes0"], ["nchw"]),
        _const("sizes", np.array([1, channels, height, width], np.int64)),
        helper.make_node("Resize", ["nchw", "", "", "sizes"], ["resized"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Round", ["resized"], ["rounded"]),
        _const("lo", np.array(0, np.float32)), _const("hi", np.array(255, np.float32)),
        helper.make_node("Clip", ["rounded", "lo", "hi"], ["pixels"]),
        _const("mul", mul), _const("sub", sub),
        helper.make_node("Mul", ["pixels", "mul"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "sub"], [output]),
        # geometry: scale_x = width / W, scale_y = height / H, no padding, no crop
        helper.make_node("Shape", ["frame"], ["shape"]),
        _const("hw_idx", np.array([1, 0], np.int64)),
        helper.make_node("Gather", ["shape", "hw_idx"], ["wh"]),
        helper.make_node("Cast", ["wh"], ["whf"], to=TensorProto.FLOAT),
        _const("target", np.array([width, height], np.float32)),
        helper.make_node("Div", ["target", "whf"], ["scales"]),
        _const("zeros", np.zeros(4, np.float32)),
        helper.make_node("Concat", ["scales", "zeros"], ["geometry"], axis=0),
    ]
    inputs = [helper.make_tensor_value_info("frame", TensorProto.UINT8, ["h", "w", channels])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, height, width]),
               helper.make_tensor_value_info("geometry", TensorProto.FLOAT, [6])]
    return _save(nodes, inputs, outputs, path, "stretch_pre")


def softmax_post(path: Path, logits: str, classes: int, output: str = "probabilities") -> Path:
    """logits [1, C] -> probabilities [C]."""
    nodes = [
        helper.make_node("Softmax", [logits], ["p"], axis=-1),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Squeeze", ["p", "axes0"], [output]),
    ]
    inputs = [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [1, classes])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [classes])]
    return _save(nodes, inputs, outputs, path, "softmax_post")


def constant_head_model(path: Path, head: np.ndarray, input_name: str = "images", size: int = 32,
                        output: str = "output") -> Path:
    """A stand-in detector: input [B, 3, size, size] float32 -> `head` [1, N, D] plus 0 * mean(input), so the
    graph depends on its input (calibration and the contract see a real model) and answers are known exactly."""
    nodes = [
        helper.make_node("ReduceMean", [input_name], ["m"], keepdims=1),  # [B, 1, 1, 1]
        _const("zero", np.array(0.0, np.float32)),
        helper.make_node("Mul", ["m", "zero"], ["z4"]),
        _const("shape3", np.array([-1, 1, 1], np.int64)),
        helper.make_node("Reshape", ["z4", "shape3"], ["z"]),
        _const("head", head.astype(np.float32)),
        helper.make_node("Add", ["head", "z"], [output]),
    ]
    inputs = [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 3, size, size])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", head.shape[1], head.shape[2]])]
    return _save(nodes, inputs, outputs, path, "constant_head")


def yolox_head(grid: int, stride: int, boxes: Sequence[tuple[int, int, float, float, float, float]]) -> np.ndarray:
    """A YOLOX-style raw head [1, grid*grid, 6] for one class: per cell (dx, dy, log w, log h, objectness,
    class score), grid-relative; `boxes`: (cell x, cell y, dx, dy, w px, h px) cells that hold an object."""
    head = np.zeros((1, grid * grid, 6), np.float32)
    head[0, :, 2:4] = np.log(1.0)
    head[0, :, 4] = 0.01
    head[0, :, 5] = 0.5
    for cx, cy, dx, dy, w, h in boxes:
        k = cy * grid + cx
        head[0, k] = [dx, dy, np.log(w / stride), np.log(h / stride), 0.95, 0.9]
    return head


def yolox_answers(head: np.ndarray, grid: int, stride: int, scale_x: float, scale_y: float,
                  threshold: float = 0.25) -> dict:
    """What the package's own decode serves for this head: grid/stride decode, objectness x class, boxes mapped
    to frame pixels by the stretch's scale (the reference a wrong decoder must fail against)."""
    out = []
    for k in range(grid * grid):
        dx, dy, lw, lh, obj, cls = head[0, k].astype(np.float64)
        score = obj * cls
        if score <= threshold:
            continue
        cx, cy = (dx + k % grid) * stride, (dy + k // grid) * stride
        w, h = np.exp(lw) * stride, np.exp(lh) * stride
        box = [(cx - w / 2) / scale_x, (cy - h / 2) / scale_y, (cx + w / 2) / scale_x, (cy + h / 2) / scale_y]
        out.append({"box": [round(float(v), 3) for v in box], "score": round(float(score), 6), "class_id": 0})
    return {"type": "boxes", "boxes": out}


def grid_decode_post(path: Path, grid: int, stride: int, head_name: str = "output", threshold: float = 0.25) -> Path:
    """The YOLOX-style decode as a post graph: head [1, N, 6] + geometry [6] -> det_boxes [M, 4] (frame pixels),
    det_scores [M], det_classes [M] int64, for cells whose objectness x class score is over `threshold`."""
    xs, ys = np.meshgrid(np.arange(grid), np.arange(grid))
    cells = np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.float32)  # [N, 2] (x, y)
    nodes = [
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Squeeze", [head_name, "axes0"], ["h"]),  # [N, 6]
        _const("s0", np.array([0], np.int64)), _const("s2", np.array([2], np.int64)),
        _const("s4", np.array([4], np.int64)), _const("s5", np.array([5], np.int64)),
        _const("s6", np.array([6], np.int64)), _const("ax1", np.array([1], np.int64)),
        helper.make_node("Slice", ["h", "s0", "s2", "ax1"], ["dxy"]),
        helper.make_node("Slice", ["h", "s2", "s4", "ax1"], ["lwh"]),
        helper.make_node("Slice", ["h", "s4", "s5", "ax1"], ["obj"]),
        helper.make_node("Slice", ["h", "s5", "s6", "ax1"], ["cls"]),
        _const("cells", cells), _const("stride", np.array(float(stride), np.float32)),
        helper.make_node("Add", ["dxy", "cells"], ["cxy_g"]),
        helper.make_node("Mul", ["cxy_g", "stride"], ["cxy"]),
        helper.make_node("Exp", ["lwh"], ["ewh"]),
        helper.make_node("Mul", ["ewh", "stride"], ["wh"]),
        _const("half", np.array(0.5, np.float32)),
        helper.make_node("Mul", ["wh", "half"], ["hwh"]),
        helper.make_node("Sub", ["cxy", "hwh"], ["xy1"]),
        helper.make_node("Add", ["cxy", "hwh"], ["xy2"]),
        helper.make_node("Concat", ["xy1", "xy2"], ["xyxy_in"], axis=1),  # [N, 4] input pixels
        # frame pixels: (x - pad_x + crop_x) / scale_x, likewise y
        _const("g_s", np.array([0], np.int64)), _const("g_e", np.array([2], np.int64)),
        _const("g_ps", np.array([2], np.int64)), _const("g_pe", np.array([4], np.int64)),
        _const("g_cs", np.array([4], np.int64)), _const("g_ce", np.array([6], np.int64)),
        helper.make_node("Slice", ["geometry", "g_s", "g_e"], ["sc"]),
        helper.make_node("Slice", ["geometry", "g_ps", "g_pe"], ["pad"]),
        helper.make_node("Slice", ["geometry", "g_cs", "g_ce"], ["crop"]),
        helper.make_node("Concat", ["sc", "sc"], ["sc4"], axis=0),
        helper.make_node("Concat", ["pad", "pad"], ["pad4"], axis=0),
        helper.make_node("Concat", ["crop", "crop"], ["crop4"], axis=0),
        helper.make_node("Sub", ["xyxy_in", "pad4"], ["b1"]),
        helper.make_node("Add", ["b1", "crop4"], ["b2"]),
        helper.make_node("Div", ["b2", "sc4"], ["xyxy"]),
        helper.make_node("Mul", ["obj", "cls"], ["score2"]),
        helper.make_node("Squeeze", ["score2", "ax1"], ["score"]),  # [N]
        _const("thr", np.array(threshold, np.float32)),
        helper.make_node("Greater", ["score", "thr"], ["keep"]),
        helper.make_node("NonZero", ["keep"], ["nz"]),  # [1, M]
        helper.make_node("Squeeze", ["nz", "axes0"], ["idx"]),  # [M]
        helper.make_node("Gather", ["xyxy", "idx"], ["det_boxes"], axis=0),
        helper.make_node("Gather", ["score", "idx"], ["det_scores"], axis=0),
        helper.make_node("Mul", ["idx", "zero_i"], ["det_classes"]),
        _const("zero_i", np.array(0, np.int64)),
    ]
    # a topological order: the constant feeding Mul must come first
    nodes = [n for n in nodes if n.output[0] == "zero_i"] + [n for n in nodes if n.output[0] != "zero_i"]
    inputs = [helper.make_tensor_value_info(head_name, TensorProto.FLOAT, [1, grid * grid, 6]),
              helper.make_tensor_value_info("geometry", TensorProto.FLOAT, [6])]
    outputs = [helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, ["m", 4]),
               helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, ["m"]),
               helper.make_tensor_value_info("det_classes", TensorProto.INT64, ["m"])]
    return _save(nodes, inputs, outputs, path, "grid_decode_post")


def boxes_keypoints_post(path: Path, head_name: str, n: int, k: int) -> Path:
    """head [1, N, 5 + 2K] (x1, y1, x2, y2, score, K keypoints x, y; input pixels) + geometry -> det_boxes [N, 4],
    det_scores [N], det_kps [N, K, 2] in frame pixels (x / scale_x, y / scale_y: a stretch, no padding)."""
    nodes = [
        _const("axes0", np.array([0], np.int64)), _const("ax1", np.array([1], np.int64)),
        helper.make_node("Squeeze", [head_name, "axes0"], ["h"]),
        _const("s0", np.array([0], np.int64)), _const("s4", np.array([4], np.int64)),
        _const("s5", np.array([5], np.int64)), _const("send", np.array([5 + 2 * k], np.int64)),
        helper.make_node("Slice", ["h", "s0", "s4", "ax1"], ["b_in"]),
        helper.make_node("Slice", ["h", "s4", "s5", "ax1"], ["sc2"]),
        helper.make_node("Squeeze", ["sc2", "ax1"], ["det_scores"]),
        helper.make_node("Slice", ["h", "s5", "send", "ax1"], ["kp_flat"]),
        _const("kshape", np.array([n, k, 2], np.int64)),
        helper.make_node("Reshape", ["kp_flat", "kshape"], ["kp_in"]),
        _const("g_s", np.array([0], np.int64)), _const("g_e", np.array([2], np.int64)),
        helper.make_node("Slice", ["geometry", "g_s", "g_e"], ["sc"]),  # (scale_x, scale_y)
        helper.make_node("Concat", ["sc", "sc"], ["sc4"], axis=0),
        helper.make_node("Div", ["b_in", "sc4"], ["det_boxes"]),
        helper.make_node("Div", ["kp_in", "sc"], ["det_kps"]),
    ]
    inputs = [helper.make_tensor_value_info(head_name, TensorProto.FLOAT, [1, n, 5 + 2 * k]),
              helper.make_tensor_value_info("geometry", TensorProto.FLOAT, [6])]
    outputs = [helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, [n, 4]),
               helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, [n]),
               helper.make_tensor_value_info("det_kps", TensorProto.FLOAT, [n, k, 2])]
    return _save(nodes, inputs, outputs, path, "boxes_keypoints_post")


def native_pre(path: Path, output: str, scale: float = 1 / 255, channels: int = 3) -> Path:
    """frame uint8 [H, W, C] -> NCHW float32 [1, C, H, W] * scale at the frame's own size (a native-resolution
    input, no resize); no geometry output (identity)."""
    nodes = [
        helper.make_node("Cast", ["frame"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["chw"], perm=[2, 0, 1]),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["chw", "axes0"], ["nchw"]),
        _const("scale", np.array(scale, np.float32)),
        helper.make_node("Mul", ["nchw", "scale"], [output]),
    ]
    inputs = [helper.make_tensor_value_info("frame", TensorProto.UINT8, ["h", "w", channels])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, "h", "w"])]
    return _save(nodes, inputs, outputs, path, "native_pre")


def width_coordinate_model(path: Path, input_name: str = "images", output: str = "extent") -> Path:
    """A dynamic-size model computing a coordinate from its input's width (as in-graph prior centres do):
    extent = max over x of (2 * x + mean of a 1x1 conv), about 2 * (W - 1). A whole-graph INT8 calibrated on
    narrow frames clips it to the calibrated range on wider ones (the face detector's priors at ~512 px)."""
    w = np.full((1, 3, 1, 1), 1 / 3, np.float32)
    nodes = [
        _const("w", w), helper.make_node("Conv", [input_name, "w"], ["feat"]),
        helper.make_node("ReduceMean", ["feat"], ["fm"], keepdims=0),
        helper.make_node("Shape", [input_name], ["shp"]), _const("i3", np.array([3], np.int64)),
        helper.make_node("Gather", ["shp", "i3"], ["W"]), helper.make_node("Squeeze", ["W"], ["Ws"]),
        _const("z", np.array(0, np.int64)), _const("one", np.array(1, np.int64)),
        helper.make_node("Range", ["z", "Ws", "one"], ["xs"]),
        helper.make_node("Cast", ["xs"], ["xf"], to=TensorProto.FLOAT),
        _const("k", np.array([2.0], np.float32)), helper.make_node("Mul", ["xf", "k"], ["xk"]),
        helper.make_node("Add", ["xk", "fm"], ["xa"]),
        helper.make_node("ReduceMax", ["xa"], ["xmax"], keepdims=1),
        _const("shape11", np.array([1, 1], np.int64)), helper.make_node("Reshape", ["xmax", "shape11"], [output]),
    ]
    inputs = [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 3, "h", "w"])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 1])]
    return _save(nodes, inputs, outputs, path, "width_coordinate")


def window_pre(path: Path, output: str, window: int, channels: int, divide: float) -> Path:
    """A sensor window float32 [window, channels] -> [1, channels, window] / divide (NCW)."""
    nodes = [
        helper.make_node("Transpose", ["frame"], ["cw"], perm=[1, 0]),
        _const("axes0", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["cw", "axes0"], ["ncw"]),
        _const("d", np.array(divide, np.float32)),
        helper.make_node("Div", ["ncw", "d"], [output]),
    ]
    inputs = [helper.make_tensor_value_info("frame", TensorProto.FLOAT, [window, channels])]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, window])]
    return _save(nodes, inputs, outputs, path, "window_pre")


def two_output_model(path: Path, input_name: str = "images", size: int = 32) -> Path:
    """`scores` [B, 3] (a 1x1 conv's channel means) and `aux` [B, 1], the log of a negative number: NaN, an
    output no bundle should use."""
    w = np.arange(9, dtype=np.float32).reshape(3, 3, 1, 1) / 9
    nodes = [
        _const("w", w), helper.make_node("Conv", [input_name, "w"], ["c"]),
        helper.make_node("ReduceMean", ["c"], ["scores"], axes=[2, 3], keepdims=0),
        helper.make_node("ReduceMean", [input_name], ["m"], axes=[1, 2, 3], keepdims=0),
        _const("neg", np.array(-1.0, np.float32)), helper.make_node("Mul", ["m", "neg"], ["n"]),
        _const("eps", np.array(-1e-3, np.float32)), helper.make_node("Add", ["n", "eps"], ["n2"]),
        helper.make_node("Log", ["n2"], ["l"]),
        _const("s", np.array([-1, 1], np.int64)), helper.make_node("Reshape", ["l", "s"], ["aux"]),
    ]
    inputs = [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 3, size, size])]
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3]),
               helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["batch", 1])]
    return _save(nodes, inputs, outputs, path, "two_outputs")


# ---------------------------------------------------------------- the demo classifier through equivalent graphs

DEMO_GRAPH_SPEC = {"name": "digits-graph", "version": 1, "label": "1.0.0", "task": "classes",
                   "frame": {"kind": "image", "height": 160, "width": 160, "channels": 3, "color": "rgb"},
                   "postprocess": {"result": {"kind": "classes", "probabilities": "probabilities", "top_k": 3}}}


def demo_answers(frames: Sequence[Path], d: Path, wrong: int = 0, produced_by: str = "tests/stage_graphs.py") -> Path:
    """`d` with copies of `frames` and the package's answers beside them: what the declarative demo bundle
    serves on each (kind classes); the first `wrong` are answered with the next label instead."""
    import json
    import shutil

    from agent.bundle.load import load_bundle
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.vocabulary.preprocess import read_image_file
    from agentproc import DEMO_BUNDLE

    d.mkdir(parents=True, exist_ok=True)
    engine = build_engine(load_bundle(DEMO_BUNDLE), Candidate(CPU, "fp32", "fp32"), SessionSettings())
    labels = list(engine.labels)
    results = []
    for i, p in enumerate(frames):
        shutil.copy(p, d / p.name)
        raw = read_image_file(str(p), engine.bundle.manifest.frame)
        tensor, geometry = engine.preprocessor.with_geometry(raw)
        r = engine.decode({k: v[0] for k, v in engine.run(tensor).items()}, geometry, 65536)
        if i < wrong:
            k = (labels.index(r["top"][0]["label"]) + 1) % len(labels)
            r = {**r, "top": [{**r["top"][0], "label": labels[k], "class_id": k, "score": 0.99}]}
        results.append({**r, "type": "classes"})
    (d / "answers.json").write_text(json.dumps({"kind": "classes", "package": "digits-classifier declarative",
                                                "produced_by": produced_by, "results": results}))
    return d


def demo_graph_bundle(d: Path, int8: bool = False, heldout: Path | None = None, keep_low_quality: bool = False) -> Path:
    """The demo classifier built with `bundle create --pre-graph --post-graph`: the graphs state what the demo's
    declarative preprocessing (stretch 160 -> 128, (x/255 - 0.5) / 0.25, NCHW) and softmax do; golden = the
    first 8 demo frames with the declarative demo's answers."""
    import yaml

    from agent.bundle.create import CreateOptions, create_bundle
    from agent.bundle.load import load_bundle
    from agentproc import DEMO_BUNDLE, DEMO_FRAMES

    m = load_bundle(DEMO_BUNDLE).manifest
    pre = stretch_pre(d / "pre.onnx", "input", 128, 128, m.preprocess.scale, m.preprocess.mean, m.preprocess.std)
    post = softmax_post(d / "post.onnx", "logits", 10)
    golden = demo_answers(sorted(DEMO_FRAMES.glob("*.png"))[:8], d / "golden")
    (d / "spec.yaml").write_text(yaml.safe_dump(DEMO_GRAPH_SPEC))
    return create_bundle(CreateOptions(model=DEMO_BUNDLE / "model_fp32.onnx", spec=d / "spec.yaml",
                                       calibration=golden, golden=golden, heldout=heldout, out=d / "bundle",
                                       labels=DEMO_BUNDLE / "labels.txt", int8=int8, pre_graph=pre, post_graph=post,
                                       keep_low_quality=keep_low_quality))
