"""What the demo build scripts share: seeded setup, and export -> ORT-vs-PyTorch check -> bundle create."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.bundle.build_spec import read_spec  # noqa: E402
from agent.bundle.create import CreateOptions, create_bundle  # noqa: E402
from agent.vocabulary.manifest import FrameSpec, preprocess_from_dict  # noqa: E402
from agent.vocabulary.preprocess import Preprocessor  # noqa: E402

MAX_EXPORT_ERROR = 1e-5


def seeded_setup(spec_path: Path, seed: int) -> tuple[dict[str, Any], Preprocessor]:
    """Seed PyTorch (2 threads, as on the device class we target); the bundle's own Preprocessor."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    spec = read_spec(spec_path)
    return spec, Preprocessor(preprocess_from_dict(spec["preprocess"]), FrameSpec(**spec["frame"]))


def export_check_and_bundle(net: Any, pre: Preprocessor, golden_raw: np.ndarray, golden_ref: np.ndarray,
                            input_name: str, output_name: str, data: Path, spec_path: Path, out: Path) -> bool:
    """torch.onnx.export (opset 17, dynamic batch); refuse when ORT (no graph optimisation) differs from
    PyTorch by more than 1e-5 on the golden set; else `bundle create` with the saved sample sets."""
    import onnxruntime as ort
    import torch

    onnx_path = data / f"{out.name}_fp32_source.onnx"
    torch.onnx.export(net, torch.from_numpy(pre(golden_raw[0])), str(onnx_path), opset_version=17, dynamo=False,
                      input_names=[input_name], output_names=[output_name],
                      dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}})
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    ort_out = np.concatenate([sess.run(None, {input_name: pre(f)})[0] for f in golden_raw])
    diff = float(np.max(np.abs(ort_out - golden_ref)))
    print(f"ORT vs PyTorch on {len(golden_raw)} golden samples: max abs {diff:.2e}")
    if diff > MAX_EXPORT_ERROR:
        print(f"ORT disagrees with PyTorch by more than {MAX_EXPORT_ERROR:g}; not bundling", file=sys.stderr)
        return False
    if out.exists():
        shutil.rmtree(out)
    create_bundle(CreateOptions(model=onnx_path, spec=spec_path, calibration=data / "calibration.npz",
                                golden=data / "golden.npz", heldout=data / "heldout.npz",
                                labels=data / "labels.txt", out=out, method="minmax", per_channel=True))
    onnx_path.unlink()  # the bundle holds the model; the source export is rebuilt by the script
    print(f"bundle written to {out}")
    return True


def rebundle(name: str, data: Path, spec_path: Path, out: Path | None = None) -> Path:
    """`bundle create` again from a committed demo bundle's own FP32 export and its saved sample sets
    (no training, no PyTorch): a bundle made by an older `bundle create` gains what today's records
    (each variant's outputs on every golden sample, the Wilson bounds, the recording environment)."""
    import tempfile

    bundle = ROOT / "models" / name
    out = out or bundle
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        src = Path(tmp) / f"{name}_fp32_source.onnx"
        shutil.copyfile(bundle / "model_fp32.onnx", src)
        staged = Path(tmp) / name
        labels = data / "labels.txt"
        create_bundle(CreateOptions(model=src, spec=spec_path, calibration=data / "calibration.npz",
                                    golden=data / "golden.npz", heldout=data / "heldout.npz",
                                    labels=labels if labels.exists() else None, out=staged,
                                    method="minmax", per_channel=True))
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
    print(f"bundle written to {out}")
    return out
