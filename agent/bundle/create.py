"""`edge-agent bundle create`: a user's ONNX model -> a verified bundle with FP32 and INT8 variants.

Build-time only (needs the `build` extra: onnx, sympy). Checks the model, records its contract,
quantizes to static QDQ INT8 calibrated through the bundle's own preprocessing, measures quality on
a held-out set, writes golden samples with reference outputs and each variant's own recorded outputs,
hashes everything, and refuses a variant under a fidelity floor (or marks it `below_floor`). Works in a staging directory: a refusal leaves nothing behind.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import yaml

from agent.bundle.load import hash_files, load_bundle
from agent.errors import BundleError, QualityError
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.spec.manifest import MANIFEST_NAME, FrameSpec, postprocess_from_dict, preprocess_from_dict
from agent.proof.parity import fidelity_floors, judge_fidelity
from agent.spec.decoders import split_batch
from agent.spec.preprocess import Preprocessor
from agent.bundle.samples import load_samples
from agent.proof.session import measure_latency
from agent.proof.terms import CPU

log = get_logger("bundle.create")

Method = Literal["minmax", "entropy", "percentile"]

ALL_PROVIDERS = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider", CPU]
PROVIDERS_BY_PRECISION = {
    "fp32": ALL_PROVIDERS,
    "int8": ["TensorrtExecutionProvider", "OpenVINOExecutionProvider", CPU],
    "fp16": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider"],
}
SPEC_KEYS = {"name", "version", "label", "task", "frame", "preprocess", "postprocess", "selftest", "preference", "source"}

_ONNX_DTYPES = {1: "float32", 10: "float16", 2: "uint8", 3: "int8", 6: "int32", 7: "int64"}


@dataclass(frozen=True)
class CreateOptions:
    model: Path
    spec: Path
    calibration: Path
    golden: Path
    out: Path
    heldout: Path | None = None
    labels: Path | None = None
    method: Method = "minmax"
    per_channel: bool = True
    exclude_nodes: tuple[str, ...] = ()
    exclude_op_types: tuple[str, ...] = ()
    int8: bool = True
    fp16: bool = False
    calibration_limit: int = 256
    max_top1_drop: float = 1.0  # percentage points of held-out top-1
    min_agreement: float = 0.97  # agreement with FP32 when there are no labels
    keep_low_quality: bool = False


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


def _need_build_extra() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise BundleError("`bundle create` needs the build tools: pip install 'edge-agent[build]'") from exc
    return onnx


def read_spec(path: Path) -> dict[str, Any]:
    try:
        spec = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BundleError(f"{path}: cannot read bundle spec: {exc}") from exc
    if not isinstance(spec, dict):
        raise BundleError(f"{path}: a bundle spec is a mapping")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise BundleError(f"{path}: key {unknown[0]}: unknown key (known: {sorted(SPEC_KEYS)})")
    for key in ("name", "version", "task", "frame", "preprocess", "postprocess"):
        if key not in spec:
            raise BundleError(f"{path}: key {key}: required")
    return spec


def _dims(value_info: Any) -> list[int | str]:
    out: list[int | str] = []
    for i, d in enumerate(value_info.type.tensor_type.shape.dim):
        if d.HasField("dim_value"):
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


def prepare_fp32(model_path: Path, dest: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """onnx.checker, opset >= 13 (per-channel QDQ needs DequantizeLinear axis), contract from the graph."""
    onnx = _need_build_extra()
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
    if len(inputs) != 1:
        raise BundleError(f"{model_path}: bundles take models with exactly one input tensor, found {[i.name for i in inputs]}")
    return _tensor_dict(inputs[0]), [_tensor_dict(o) for o in model.graph.output], opset


class _Reader:
    """ORT CalibrationDataReader over preprocessed tensors, logging progress on long calibrations."""

    def __init__(self, name: str, tensors: Sequence[np.ndarray]):
        self.name, self.tensors, self.i = name, tensors, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.tensors):
            return None
        t = self.tensors[self.i]
        self.i += 1
        if self.i % 64 == 0 or self.i == len(self.tensors):
            log.info("bundle.create.calibrating", done=self.i, total=len(self.tensors))
        return {self.name: t}

    def rewind(self) -> None:
        self.i = 0


def quantize_int8(fp32: Path, out: Path, input_name: str, calib: Sequence[np.ndarray], opts: CreateOptions) -> dict[str, Any]:
    onnx = _need_build_extra()
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        t0 = time.perf_counter()
        try:
            quant_pre_process(str(fp32), str(pre), auto_merge=True)
        except Exception as exc:
            raise BundleError(f"{fp32}: ORT quantization pre-processing failed: {exc}") from exc
        exclude = list(opts.exclude_nodes)
        if opts.exclude_op_types:
            graph = onnx.load(str(pre)).graph
            exclude += [n.name for n in graph.node if n.op_type in opts.exclude_op_types]
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[opts.method]
        # uint8 activations with int8 weights: the S8S8 default is not fused on x86 and runs slower than FP32.
        quantize_static(
            str(pre), str(out), _Reader(input_name, calib),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=opts.per_channel,
            calibrate_method=method,
            nodes_to_exclude=exclude,
        )
    return {"format": "QDQ", "activations": "uint8", "weights": "int8", "per_channel": opts.per_channel,
            "method": opts.method, "calibration_samples": len(calib), "excluded_nodes": exclude,
            "seconds": round(time.perf_counter() - t0, 1)}


def convert_fp16(fp32: Path, out: Path) -> dict[str, Any]:
    onnx = _need_build_extra()
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True)
    onnx.save(model, str(out))
    return {"keep_io_types": True}


def _cpu_session(path: Path, optimize: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=[CPU])


def _run_all(sess: Any, tensors: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
    name = sess.get_inputs()[0].name
    outs = [o.name for o in sess.get_outputs()]
    return [dict(zip(outs, sess.run(None, {name: t}))) for t in tensors]


def _latency_ms(sess: Any, tensor: np.ndarray, runs: int = 40) -> dict[str, float]:
    name = sess.get_inputs()[0].name
    stats = measure_latency(lambda t: sess.run(None, {name: t}), tensor, warmup=5, runs=runs)
    return {"cpu_p50_ms": round(stats.p50_ms, 3), "cpu_p95_ms": round(stats.p95_ms, 3)}


def _unbatch(outs: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [split_batch(o, 0) for o in outs]


def _top1(outs: Sequence[Mapping[str, np.ndarray]], output: str) -> np.ndarray:
    return np.asarray([int(np.argmax(o[output])) for o in outs])


def create_bundle(opts: CreateOptions) -> Path:
    """Build the bundle at `opts.out` (must not exist). Returns its path."""
    spec = read_spec(opts.spec)
    out = Path(opts.out)
    if out.exists():
        raise BundleError(f"{out}: already exists; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes 0700; a bundle is read by the service's own user
    try:
        _build(spec, opts, staging)
        load_bundle(staging)  # the same checks a device runs, before anything is published
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("bundle.create.done", out=str(out))
    return out


def _build(spec: dict[str, Any], opts: CreateOptions, root: Path) -> None:
    frame = FrameSpec(**spec["frame"])
    pre = Preprocessor(preprocess_from_dict(spec["preprocess"]), frame)
    post = postprocess_from_dict(spec["postprocess"])
    task = spec["task"]

    fp32_file = "model_fp32.onnx"
    input_spec, outputs, opset = prepare_fp32(opts.model, root / fp32_file)
    log.info("bundle.create.model_checked", opset=opset, input=input_spec, outputs=[o["name"] for o in outputs])

    calib_set = load_samples(opts.calibration, frame, limit=opts.calibration_limit)
    golden_set = load_samples(opts.golden, frame)
    held = load_samples(opts.heldout, frame) if opts.heldout else None
    log.info("bundle.create.samples", calibration=len(calib_set), golden=len(golden_set),
             heldout=len(held) if held else 0)
    calib = [pre(r) for r in calib_set.raw]
    golden_inputs = [pre(r) for r in golden_set.raw]
    output_names = [o["name"] for o in outputs]

    # Reference outputs: the source framework's when given, else FP32 on CPU with no graph optimisation.
    fp32_ref_sess = _cpu_session(root / fp32_file, optimize=False)
    ort_ref = _run_all(fp32_ref_sess, golden_inputs)
    source_check: dict[str, Any] = {}
    if golden_set.references:
        missing = [n for n in output_names if n not in golden_set.references]
        if missing:
            raise BundleError(f"{opts.golden}: reference outputs missing for {missing}")
        references = [{n: golden_set.references[n][i][np.newaxis] for n in output_names} for i in range(len(golden_set))]
        diff = max(float(np.max(np.abs(ort_ref[i][n] - references[i][n]))) for i in range(len(references)) for n in output_names)
        source_check = {"golden_max_abs_vs_source": float(f"{diff:.3g}")}
        reference_origin = "source framework"
    else:
        references = ort_ref
        reference_origin = "onnxruntime CPU fp32, optimisations disabled"

    builds = [VariantBuild("fp32", "fp32", fp32_file, dict(source_check))]
    if opts.int8:
        log.info("bundle.create.quantizing", method=opts.method, per_channel=opts.per_channel, samples=len(calib))
        q = quantize_int8(root / fp32_file, root / "model_int8.onnx", input_spec["name"], calib, opts)
        builds.append(VariantBuild("int8", "int8", "model_int8.onnx", quantization=q))
    if opts.fp16:
        builds.append(VariantBuild("fp16", "fp16", "model_fp16.onnx", quantization=convert_fp16(root / fp32_file, root / "model_fp16.onnx")))

    held_inputs = [pre(r) for r in held.raw] if held else []
    held_ref = _run_all(_cpu_session(root / fp32_file, optimize=True), held_inputs) if held else []
    floors = fidelity_floors(task, (spec.get("selftest") or {}).get("fidelity"))
    cls_out = post.output or output_names[0]
    own: dict[str, list[dict[str, np.ndarray]]] = {}  # each variant's own golden outputs, recorded
    for b in builds:
        sess = _cpu_session(root / b.file, optimize=True)  # as a device runs it: graph optimisation "all"
        own[b.name] = _run_all(sess, golden_inputs)
        b.recorded = {"onnxruntime": _ort_version(), "provider": CPU, "graph_optimization": "all"}
        g = judge_fidelity(post, _unbatch(own[b.name]), _unbatch(references), floors, stage="build golden")
        b.quality.update(_figures("golden_", g))
        problems = [f.text() for f in g.findings]
        if held:
            log.info("bundle.create.evaluating", variant=b.name, heldout=len(held))
            outs = _run_all(sess, held_inputs)
            h = judge_fidelity(post, _unbatch(outs), _unbatch(held_ref), floors, stage="build held-out vs fp32")
            b.quality.update(_figures("heldout_", h))
            b.quality["heldout_samples"] = len(held)
            problems += [f.text() for f in h.findings]
            if held.labels is not None and task == "classification":
                b.quality["heldout_top1"] = round(float(np.mean(_top1(outs, cls_out).ravel() == held.labels)), 5)
        b.quality.update(_latency_ms(sess, golden_inputs[0]))
        b.quality["size_bytes"] = (root / b.file).stat().st_size
        b.problems = problems
    _quality_gate(builds, task, opts)

    labels_rel = None
    if opts.labels:
        labels_rel = "labels.txt"
        shutil.copyfile(opts.labels, root / labels_rel)
    golden_files = []
    (root / "golden").mkdir()
    for i, (raw, t, ref) in enumerate(zip(golden_set.raw, golden_inputs, references)):
        rel = f"golden/sample_{i:03d}.npz"
        recorded = {f"variant.{b.name}.{n}": own[b.name][i][n] for b in builds for n in output_names}
        np.savez_compressed(root / rel, raw=raw, input=t, **{f"output.{n}": ref[n] for n in output_names}, **recorded)
        golden_files.append(rel)

    postprocess = dict(spec["postprocess"])
    if labels_rel:
        postprocess["labels"] = labels_rel
    # The author's floors and bounds pass through unchanged: a build never writes a gate from what it measured.
    selftest = dict(spec.get("selftest", {}))
    slowest = max(b.quality["cpu_p95_ms"] for b in builds)
    # A budget relative to the build machine: generous enough for a slower device, tight enough to
    # catch a model that silently runs on the wrong provider. Bundles for known devices should set it.
    selftest.setdefault("latency_budget_ms", {"default": round(max(50.0, 10 * slowest), 1)})
    preference = spec.get("preference") or {CPU: [b.name for b in builds if CPU in PROVIDERS_BY_PRECISION[b.precision]]}
    manifest: dict[str, Any] = {
        "format": 1,
        "name": spec["name"],
        "version": int(spec["version"]),
        "label": str(spec.get("label", "0.1.0")),
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "source": _source(spec.get("source", {}), opts.model, reference_origin),
        "task": task,
        "input": {**input_spec, "frame": spec["frame"]},
        "outputs": outputs,
        "preprocess": spec["preprocess"],
        "postprocess": postprocess,
        "variants": [
            {"name": b.name, "file": b.file, "precision": b.precision,
             "providers": PROVIDERS_BY_PRECISION[b.precision], "quality": b.quality,
             **({"quantization": b.quantization} if b.quantization else {}),
             "recorded": b.recorded, **({"below_floor": b.below_floor} if b.below_floor else {})}
            for b in builds
        ],
        "preference": preference,
        "selftest": selftest,
        "golden": golden_files,
        "files": {},
    }
    manifest["files"] = hash_files(root)
    (root / MANIFEST_NAME).write_text(yaml.safe_dump(manifest, sort_keys=False, width=120))


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


def _quality_gate(builds: Sequence[VariantBuild], task: str, opts: CreateOptions) -> None:
    """Refuse (or, with --keep-low-quality, mark `below_floor`) every variant under a fidelity floor
    or an author's bound. Floors come from the spec or the per-task defaults, never from a measurement."""
    fp32 = builds[0].quality
    for b in builds:
        q = b.quality
        problems = list(b.problems)
        if b is not builds[0] and "heldout_top1" in q and "heldout_top1" in fp32:
            drop = (fp32["heldout_top1"] - q["heldout_top1"]) * 100
            q["top1_drop_points"] = round(drop, 3)
            if drop > opts.max_top1_drop:
                problems.append(f"{b.name} held-out top-1 {q['heldout_top1']:.4f} is {drop:.2f} points under fp32 "
                                f"{fp32['heldout_top1']:.4f} (bound {opts.max_top1_drop} points)")
        elif b is not builds[0] and task in ("classification", "detection"):
            key = {"classification": "top1_agreement", "detection": "recall"}[task]
            prefix = "heldout_" if f"heldout_{key}" in q else "golden_"
            value = q.get(f"{prefix}{key}")
            if value is not None and value < opts.min_agreement:
                problems.append(f"{b.name} {prefix}{key} with fp32 = {value:.4f}, under the bound {opts.min_agreement}")
        if not problems:
            continue
        problem = f"variant {b.name}: " + "; ".join(problems)
        if not opts.keep_low_quality:
            raise QualityError(f"refusing the bundle: {problem}; pass --keep-low-quality to keep it marked "
                               f"below_floor (never selected unless the config pins it)")
        b.below_floor = problem[:2000]
        log.warning("bundle.create.below_floor_kept", variant=b.name, problem=problem)
