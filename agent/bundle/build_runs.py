"""The model on the build's CPU: its contract from the graph and as ONNX Runtime serves it, each variant's own
output contract, its runs (a stateful model's step by step) and latency, the sample sequences the runs read, and
their outputs reshaped and summed up for the manifest.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agent.bundle.quantise import need_build_extra
from agent.errors import BundleError
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.proof.session import measure_latency
from agent.proof.terms import CPU
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.inputs import InputFeeder

log = get_logger("bundle.create")  # the build's events keep the command's logger


ALL_PROVIDERS = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider", CPU]
PROVIDERS_BY_PRECISION = {
    "fp32": ALL_PROVIDERS,
    "int8": ["TensorrtExecutionProvider", "OpenVINOExecutionProvider", CPU],
    "fp16": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider"],
}


_ONNX_DTYPES = {1: "float32", 10: "float16", 2: "uint8", 3: "int8", 6: "int32", 7: "int64"}


@dataclass
class VariantBuild:
    name: str
    precision: str
    file: str
    quality: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] = field(default_factory=dict)
    recorded: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # fidelity floors and author bounds it misses
    below_floor: str | None = None
    outputs: list[dict[str, Any]] | None = None  # its own output contract, where quantisation changed dims


def variant_outputs(sess: Any, outputs: Sequence[Mapping[str, Any]], name: str, where: Path) -> list[dict[str, Any]] | None:
    """What a built variant really declares (ONNX Runtime's view, as the device's contract check opens it) when
    its dims differ from FP32's (quantisation made a symbolic dim concrete, or the reverse): recorded as the
    variant's own `outputs`. Other names, ranks or dtypes are refused here, before the variant is evaluated."""
    from agent.bundle.load import _ORT_DTYPES, _ort_dims

    own = [{"name": o.name, "dtype": _ORT_DTYPES.get(o.type, o.type), "shape": _ort_dims(list(o.shape))}
           for o in sess.get_outputs()]
    key = [(o["name"], o["dtype"], len(o["shape"])) for o in own]
    if key == [(o["name"], o["dtype"], len(o["shape"])) for o in outputs]:
        for o, fp32 in zip(own, outputs):
            o["shape"] = [_symbolic_as_recorded(d, f, i) for i, (d, f) in enumerate(zip(o["shape"], fp32["shape"]))]
    else:
        raise BundleError(f"{where}: variant {name} declares outputs {[(o['name'], o['dtype'], o['shape']) for o in own]}"
                          f", FP32 {[(o['name'], o['dtype'], o['shape']) for o in outputs]}: names, dtypes and ranks "
                          "must stay those of the model")
    if [o["shape"] for o in own] == [list(o["shape"]) for o in outputs]:
        return None
    log.info("bundle.create.variant_contract", variant=name, outputs=own)
    return own


def _symbolic_as_recorded(dim: int | str | None, fp32: int | str, axis: int) -> int | str:
    """A variant's dim as the manifest records it: a symbolic dim is symbolic whatever ORT calls it (Paddle
    exports' 'p2o.DynamicDimension.0', symbolic inference's 'floor(W/2 - 1/2) + 1'), so it takes FP32's name
    where FP32's is symbolic too, else a name the schema accepts; only a size that changed is a difference."""
    if isinstance(dim, int):
        return dim
    if not isinstance(fp32, int):
        return fp32
    return dim if isinstance(dim, str) and dim.isidentifier() else ("batch" if axis == 0 else f"dim{axis}")


def _dims(value_info: Any) -> list[int | str]:
    out: list[int | str] = []
    for i, d in enumerate(value_info.type.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:  # Paddle2ONNX writes -1 for a dynamic dim
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param.isidentifier():
            out.append(d.dim_param)
        else:
            out.append("batch" if i == 0 else f"dim{i}")
    return out


def _tensor_dict(vi: Any) -> dict[str, Any]:
    elem = vi.type.tensor_type.elem_type
    if elem not in _ONNX_DTYPES:
        raise BundleError(f"tensor {vi.name!r}: element type {elem} is not supported by bundles")
    return {"name": vi.name, "dtype": _ONNX_DTYPES[elem], "shape": _dims(vi)}


def ort_view(sess: Any, tensors: Sequence[Mapping[str, Any]], kind: str, where: Path) -> list[dict[str, Any]]:
    """The contract of `tensors` (from the graph) as ONNX Runtime serves them: a dim the graph leaves
    symbolic or unnamed that ORT resolves is recorded as ORT's number, so the device's contract check
    (agent.bundle.load.check_contract, the same view) accepts the variant the build made."""
    seen = {t.name: t.shape for t in (sess.get_inputs() if kind == "input" else sess.get_outputs())}
    out = []
    for t in tensors:
        shape = seen.get(t["name"])
        if shape is None or len(shape) != len(t["shape"]):
            raise BundleError(f"{where}: {kind} {t['name']!r}: the graph declares shape {t['shape']}, ONNX Runtime "
                              f"serves {shape}: re-export the model with its {kind}s' shapes")
        out.append({**t, "shape": [o if isinstance(o, int) else g for g, o in zip(t["shape"], shape)]})
    return out


def prepare_fp32(model_path: Path, dest: Path, extra_inputs: Sequence[str] = ()) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """onnx.checker, opset >= 13 (per-channel QDQ needs DequantizeLinear axis), contract from the graph.

    `extra_inputs`: the spec's declared constant/state/metadata inputs; the one input left is the frame's."""
    onnx = need_build_extra()
    try:
        model = onnx.load(str(model_path))
        onnx.checker.check_model(model)
    except Exception as exc:
        raise BundleError(f"{model_path}: not a valid ONNX model: {exc}") from exc
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        from onnx import version_converter

        log.info("bundle.create.opset_upgrade", found=opset, to=13)
        model = version_converter.convert_version(model, 13)
        opset = 13
        onnx.save(model, str(dest))
    else:
        shutil.copyfile(model_path, dest)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    names = [i.name for i in inputs]
    unknown = [n for n in extra_inputs if n not in names]
    if unknown:
        raise BundleError(f"{model_path}: spec key inputs names {unknown}, which the model does not take (inputs: {names})")
    frame_inputs = [i for i in inputs if i.name not in extra_inputs]
    if len(frame_inputs) != 1:
        raise BundleError(
            f"{model_path}: the model takes inputs {names}; one is the frame, declare every other one in the spec "
            "under inputs (kind constant, state or metadata)"
        )
    return _tensor_dict(frame_inputs[0]), [_tensor_dict(o) for o in model.graph.output], opset


def _cpu_session(path: Path, optimize: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=[CPU])


def _run_all(sess: Any, samples: Sequence[np.ndarray], feeder: InputFeeder) -> list[dict[str, np.ndarray]]:
    """Each sample's outputs; a stateful model's sample is a sequence [T, 1, ...], run step by step with its
    state carried (fresh per sequence), outputs stacked [T, 1, ...]."""
    outs = [o.name for o in sess.get_outputs()]
    results = []
    for x in samples:
        if not feeder.stateful:
            results.append(dict(zip(outs, sess.run(None, feeder.feeds(x)))))
            continue
        feeder.reset("build")
        steps = []
        for t in x:
            o = dict(zip(outs, sess.run(None, feeder.feeds(t, "build"))))
            feeder.advance("build", o)
            steps.append(o)
        results.append({k: np.stack([o[k] for o in steps]) for k in outs})
    return results


def _latency_ms(sess: Any, feeds: dict[str, np.ndarray], runs: int = 40) -> dict[str, float]:
    stats = measure_latency(lambda f: sess.run(None, f), feeds, warmup=5, runs=runs)  # type: ignore[arg-type]  # feeds: run() takes what it is given
    return {"cpu_p50_ms": round(stats.p50_ms, 3), "cpu_p95_ms": round(stats.p95_ms, 3)}


def _used(outs: list[dict[str, np.ndarray]], uses: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """Each sample's outputs narrowed to `postprocess.uses` (all of them when it is not given)."""
    return outs if not uses else [{k: v for k, v in o.items() if k in uses} for o in outs]


def _unbatch(outs: Sequence[Mapping[str, np.ndarray]], sequence: bool = False,
             axes: Mapping[str, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Per-sample outputs without the batch dimension (on each output's batch axis); a sequence counts each of
    its steps as a sample."""
    if not sequence:
        return [split_batch(o, 0, axes) for o in outs]
    return [{k: v[t, 0] for k, v in o.items()} for o in outs for t in range(next(iter(o.values())).shape[0])]


def _top1(outs: Sequence[Mapping[str, np.ndarray]], output: str, post: Any = None) -> np.ndarray:
    """Each sample's class as the decoder decides it: a single-output binary classifier's one value is
    classes 0 and 1 (class_scores), never an argmax over one value (always 0)."""
    if post is not None:
        from dataclasses import replace as _replace

        from agent.vocabulary.decoders import class_scores

        spec = _replace(post, output=output)
        return np.asarray([int(np.argmax(class_scores(spec, o))) for o in outs])
    return np.asarray([int(np.argmax(o[output])) for o in outs])


class _Prepared(Sequence[np.ndarray]):
    """Samples preprocessed when indexed, so a large set is never held as float tensors."""

    def __init__(self, raw: Sequence[np.ndarray], prepare: Any):
        self.raw, self.prepare = raw, prepare

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: Any) -> Any:  # Sequence's overloads: an int gives a tensor
        return self.prepare(self.raw[i])


class _Extended(Sequence[np.ndarray]):
    """A sample sequence with a few frames after it (lazy sets stay lazy)."""

    def __init__(self, head: Sequence[np.ndarray], tail: Sequence[np.ndarray]):
        self.head, self.tail = head, list(tail)

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, i: Any) -> Any:  # Sequence's overloads: an int gives a frame, a slice a list
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.head[i] if i < len(self.head) else self.tail[i - len(self.head)]


def _as_batch(ref: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A source reference for one sample ([...] or [T, ...]) in the shape ONNX Runtime gave ([1, ...] / [T, 1, ...])."""
    ref = np.asarray(ref)
    if ref.size != like.size:
        raise BundleError(f"a reference output of shape {list(ref.shape)} does not fit the model's {list(like.shape)}")
    return ref.reshape(like.shape).astype(like.dtype, copy=False)


def _source(given: Mapping[str, Any], model: Path, reference_origin: str) -> dict[str, Any]:
    description = f"{given.get('description', '')} Golden references: {reference_origin}.".strip()
    return {**given, "sha256": sha256_file(model), "description": description}


def _figures(prefix: str, q: Any) -> dict[str, Any]:
    """A fidelity answer as flat quality figures for the manifest (measured: informational only)."""
    out: dict[str, Any] = {}
    if q.agreement is not None:
        for k, v in q.agreement.metrics.items():
            if v is not None and np.isfinite(v):
                out[prefix + k] = round(float(v), 6)
    if q.cosine is not None:
        out[prefix + "min_cosine"] = round(q.cosine, 6)
    return out


def _ort_version() -> str:
    import onnxruntime as ort

    return str(ort.__version__)
