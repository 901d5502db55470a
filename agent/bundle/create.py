"""`edge-agent bundle create`: a user's ONNX model -> a verified bundle with FP32 and INT8 variants.

Build-time only (needs the `build` extra: onnx, sympy). Checks the model, records its contract,
proves the spec's preprocessing reproduces the framework's own input tensors (when the samples carry
them), quantizes to static QDQ INT8 calibrated through the bundle's own preprocessing (streamed, in
bounded memory, through sequences for a stateful model), measures quality on a held-out set, writes
golden samples with reference outputs and each variant's own recorded outputs, hashes everything, and
refuses a variant under a fidelity floor (or marks it `below_floor`). Works in a staging directory: a
refusal leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import yaml

from agent.bundle.load import load_bundle, with_state_files
from agent.errors import BundleError, QualityError, StageOutputError
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.kinds import vocabulary_kinds
from agent.vocabulary.manifest import (frame_from_dict, inputs_from_list, postprocess_from_dict,
                                 preprocess_from_dict)
from agent.proof.parity import Finding, judge_fidelity
from agent.vocabulary.decoders import split_batch
from agent.bundle.jpeg_hint import jpeg_explains
from agent.vocabulary.batch_axis import spec_axes
from agent.vocabulary.preprocess import Preprocessor
from agent.bundle.samples import SampleSet
from agent.proof.session import measure_latency
from agent.proof.terms import CPU

from agent.bundle.quantise import (  # noqa: F401 (what callers import from here)
    INSTALL_BUILD_HINT, CalibrationFeeds, convert_fp16, count_quantized_nodes, need_build_extra, prequantized,
    quantize_int8, reason_of,
)

log = get_logger("bundle.create")

Method = Literal["minmax", "entropy", "percentile"]

ALL_PROVIDERS = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider", CPU]
PROVIDERS_BY_PRECISION = {
    "fp32": ALL_PROVIDERS,
    "int8": ["TensorrtExecutionProvider", "OpenVINOExecutionProvider", CPU],
    "fp16": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "OpenVINOExecutionProvider"],
}
SPEC_KEYS = {"name", "version", "label", "task", "frame", "preprocess", "postprocess", "selftest", "preference", "source",
             "inputs", "frontend", "outputs"}
# Bound on |spec preprocessing - framework input tensor| before the build refuses (tensor units).
DEFAULT_PREPROCESS_DRIFT = 1e-3

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
    # 7-bit weights (ORT's reduce_range): on x86 CPUs without VNNI (AVX2, AVX-512 without VNNI) the fused
    # u8s8 kernels add pairs of products in saturating int16, so full-range weights give other answers than
    # the graph means (measured on an AVX2 EPYC: the demo's INT8 logits 3.6 off, top-1 0.94 against FP32).
    # With 7 bits no pair can saturate, and one bundle answers the same on every CPU of a fleet.
    reduce_range: bool = True
    exclude_nodes: tuple[str, ...] = ()
    exclude_op_types: tuple[str, ...] = ()
    exclude_node_patterns: tuple[str, ...] = ()  # regular expressions over node names (re.search)
    exclude_after: tuple[str, ...] = ()  # these nodes and everything downstream of them stay float
    allow_preprocess_drift: float | None = None  # accept this max abs between spec and framework tensors
    calibration_batch: int = 8  # frames per calibration run where the input has a dynamic batch
    int8: bool = True
    fp16: bool = False
    calibration_limit: int = 256
    max_top1_drop: float = 1.0  # percentage points of held-out top-1
    min_agreement: float = 0.97  # agreement with FP32 when there are no labels
    keep_low_quality: bool = False
    pre_graph: Path | None = None  # preprocess.graph: copied into the bundle (hashed, signed), never quantised
    post_graph: Path | None = None  # postprocess.graph: likewise
    charset: Path | None = None  # postprocess.result.charset (kind text): copied into the bundle, hashed and signed
    # build a decoding bundle whose golden and held-out sets hold no package answers, the warning in its manifest
    allow_unproven_decoder: bool = False


STAGE_DEFAULT_NAMES = {"preprocess": "pre.onnx", "postprocess": "post.onnx"}


def with_stage_graphs(spec: dict[str, Any], opts: CreateOptions) -> dict[str, Any]:
    """The spec with `preprocess.graph` / `postprocess.graph` naming the files --pre-graph / --post-graph give
    (pre.onnx, post.onnx unless the spec names them); a graph the spec names without its file is refused."""
    spec = dict(spec)
    for key, given, flag in (("preprocess", opts.pre_graph, "--pre-graph"), ("postprocess", opts.post_graph,
                                                                            "--post-graph")):
        block = dict(spec.get(key) or {})
        if given is not None:
            if not Path(given).is_file():
                raise BundleError(f"{given}: {flag}: not a file")
            block.setdefault("graph", STAGE_DEFAULT_NAMES[key])
            spec[key] = block
        elif "graph" in block:
            raise BundleError(f"{opts.spec}: key {key}.graph: names {block['graph']!r}; give the ONNX file with {flag}")
    result = dict((spec.get("postprocess") or {}).get("result") or {})
    if opts.charset is not None:
        if not Path(opts.charset).is_file():
            raise BundleError(f"{opts.charset}: --charset: not a file")
        if not result:
            raise BundleError(f"{opts.spec}: key postprocess.result: --charset needs a result of kind text")
        result.setdefault("charset", CHARSET_DEFAULT_NAME)
        spec["postprocess"] = {**spec["postprocess"], "result": result}
    elif "charset" in result:
        raise BundleError(f"{opts.spec}: key postprocess.result.charset: names {result['charset']!r}; give the file "
                          "with --charset")
    return spec


CHARSET_DEFAULT_NAME = "charset.txt"


def charset_file(spec: Mapping[str, Any]) -> str | None:
    """Where the spec's text result keeps its charset inside the bundle, or None."""
    return ((spec.get("postprocess") or {}).get("result") or {}).get("charset")


def stage_files(spec: Mapping[str, Any]) -> dict[str, str]:
    """The stage graphs a spec names: manifest key -> path inside the bundle."""
    return {f"{k}.graph": (spec.get(k) or {})["graph"] for k in ("preprocess", "postprocess")
            if "graph" in (spec.get(k) or {})}


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


def read_spec(path: Path, pre_graph: bool = False) -> dict[str, Any]:
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
        if key not in spec and not (key == "preprocess" and pre_graph):  # a pre graph is the preprocessing
            raise BundleError(f"{path}: key {key}: required")
    _check_selftest_block(spec.get("selftest"), path)
    return spec


def _check_selftest_block(selftest: Any, path: Path) -> None:
    """The spec's selftest block against the manifest schema before the build judges with its floors:
    a misspelt or out-of-range floor is a spec error, not a TypeError or a quality refusal."""
    import jsonschema

    from agent.vocabulary.manifest import manifest_schema

    if selftest is None:
        return
    schema = dict(manifest_schema()["properties"]["selftest"])
    schema.pop("required", None)  # the build supplies a default latency budget
    schema["$defs"] = manifest_schema().get("$defs", {})  # for references
    for err in jsonschema.Draft202012Validator(schema).iter_errors(selftest):
        where = ".".join(str(p) for p in err.absolute_path)
        raise BundleError(f"{path}: key selftest{'.' + where if where else ''}: {err.message}")


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


PLACEHOLDER_SHA = "0" * 64


def provisional_manifest(spec: Mapping[str, Any], input_spec: Mapping[str, Any] | None = None,
                         outputs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest this spec would make, with placeholders for what the build measures (hashes, variants,
    and -- before the model is read -- the tensors): checked before anything slow starts."""
    dtype = (spec.get("preprocess") or {}).get("dtype", "float32")
    return {
        "format": 1, "name": spec["name"], "version": spec["version"], "label": str(spec.get("label", "0.1.0")),
        "created": "2000-01-01T00:00:00+00:00",
        "source": {**(spec.get("source") or {}), "sha256": PLACEHOLDER_SHA}, "task": spec["task"],
        "input": {**(input_spec or {"name": "input", "dtype": dtype, "shape": ["batch"]}), "frame": spec["frame"]},
        **({"inputs": spec["inputs"]} if spec.get("inputs") else {}),
        "outputs": list(outputs or [{"name": "output", "dtype": "float32", "shape": ["batch"]}]),
        "preprocess": spec["preprocess"], "postprocess": spec["postprocess"],
        "variants": [{"name": "fp32", "file": "model.onnx", "precision": "fp32", "providers": [CPU]}],
        "selftest": spec.get("selftest") or {}, "golden": ["golden.npz"],
        "files": {"model.onnx": PLACEHOLDER_SHA, "golden.npz": PLACEHOLDER_SHA,
                  **{rel: PLACEHOLDER_SHA for rel in stage_files(spec).values()},
                  **({charset_file(spec): PLACEHOLDER_SHA} if charset_file(spec) else {}),
                  **({spec["postprocess"]["labels"]: PLACEHOLDER_SHA} if "labels" in spec["postprocess"] else {})},
    }


def validate_spec_first(spec: Mapping[str, Any], opts: CreateOptions) -> None:
    """Every key of the spec against the manifest schema, and the labels file, before the model is read:
    a misspelt key or a bad label is refused in a second, not after quantisation and evaluation."""
    import jsonschema

    from agent.vocabulary.manifest import _describe, frame_from_dict, manifest_schema

    where = str(opts.spec)
    doc = provisional_manifest(spec)
    errors = sorted(jsonschema.Draft202012Validator(manifest_schema()).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    # keys the build fills in are placeholders here: only the author's keys can be wrong
    errors = [e for e in errors if not (e.absolute_path and e.absolute_path[0] in ("outputs", "files", "variants"))]
    if errors:
        raise BundleError(f"{where}: " + "; ".join(_describe(e) for e in errors[:5]).replace("(top level)", "spec"))
    try:
        frame_from_dict(spec["frame"], inputs_from_list(spec.get("inputs")), where)
        postprocess_from_dict(spec["postprocess"])
    except TypeError as exc:
        raise BundleError(f"{where}: {reason_of(exc)}") from exc
    if opts.labels is not None:
        try:
            labels = [x for x in Path(opts.labels).read_text().splitlines() if x.strip()]
        except OSError as exc:
            raise BundleError(f"{opts.labels}: cannot read labels: {exc.strerror}") from exc
        if not labels:
            raise BundleError(f"{opts.labels}: no labels (one class name per line)")


def validate_against_model(spec: Mapping[str, Any], input_spec: Mapping[str, Any], outputs: Sequence[Mapping[str, Any]],
                           where: str) -> None:
    """The spec against the model's real tensors with every semantic check a device runs (outputs named
    by the postprocess, decision channels, state outputs), before samples load or anything quantises."""
    from agent.vocabulary.manifest import parse_manifest

    parse_manifest(yaml.safe_dump(provisional_manifest(spec, input_spec, outputs)), where)


def create_bundle(opts: CreateOptions) -> Path:
    """Build the bundle at `opts.out` (must not exist). Returns its path."""
    spec = with_stage_graphs(read_spec(opts.spec, pre_graph=opts.pre_graph is not None), opts)
    validate_spec_first(spec, opts)
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


class _Prepared(Sequence[np.ndarray]):
    """Samples preprocessed when indexed, so a large set is never held as float tensors."""

    def __init__(self, raw: Sequence[np.ndarray], prepare: Any):
        self.raw, self.prepare = raw, prepare

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: Any) -> Any:  # Sequence's overloads: an int gives a tensor
        return self.prepare(self.raw[i])


def check_preprocess_drift(sets: Sequence[tuple[str, SampleSet, Sequence[np.ndarray]]], layout: str,
                           bound: float, graph_key: str | None = None) -> dict[str, Any]:
    """Compare the spec's tensors with the framework's own input tensors (`input` in a sample set).

    Returns what was measured (empty when no set carries `input`); raises BundleError with the worst
    sample, the max abs and a hint when the difference exceeds `bound`."""
    worst: tuple[float, str, int] = (-1.0, "", -1)
    total = 0
    for label, sset, tensors in sets:
        if sset.framework_inputs is None:
            continue
        for i, t in enumerate(tensors):
            f = np.asarray(sset.framework_inputs[i])
            if f.size != t.size:
                raise BundleError(
                    f"{sset.source}: sample {i}: the framework's input has shape {list(f.shape)}, the spec's "
                    f"preprocessing makes {list(t.shape)} (stage pre): check "
                    + (f"{graph_key} (its output shape)" if graph_key else "preprocess.resize (mode, width, height) and layout")
                )
            d = float(np.max(np.abs(t.astype(np.float64) - f.reshape(t.shape).astype(np.float64)))) if t.size else 0.0
            total += 1
            if not np.isfinite(d) or d > worst[0]:
                worst = (d, f"{label}:{i}", i)
            if not np.isfinite(d):
                break
    if total == 0:
        return {}
    measured, where, _ = worst
    record = {"measured_max_abs": float(f"{measured:.4g}"), "worst_sample": where, "samples": total,
              "bound": bound}
    if not measured <= bound:
        label, index = where.split(":")
        i = int(index)
        sset, tensors = next((s, t) for lab, s, t in sets if lab == label)
        assert sset.framework_inputs is not None  # only sets with the framework's tensors are compared
        raise BundleError(
            f"{sset.source}: stage pre: the spec's preprocessing does not reproduce the framework's input tensors: max "
            f"abs {measured:.4g} on {label} sample {i} (bound {bound:g}); "
            + (f"check {graph_key}" if graph_key else _drift_hint(tensors[i], sset.framework_inputs[i], layout)) +
            f"; or pass --allow-preprocess-drift {float(f'{measured * 1.1:.2g}'):g} to accept it (recorded in the manifest)"
        )
    return record


def explaining_key(pre: Any, frame: Any, sets: Sequence[tuple[str, SampleSet, Sequence[np.ndarray]]],
                   bound: float) -> str | None:
    """A spec change that makes the framework's tensors reproduce, named by its key, or None: the letterbox's
    rounding (packages that int() the resized side differ by up to a whole pixel row on about half of all frame
    sizes, which a mean/scale hint would misname)."""
    r = pre.spec.resize if isinstance(pre, Preprocessor) else None
    if r is None or r.mode != "letterbox":
        return jpeg_explains(pre, frame.color, sets, bound)  # a package that re-encodes each frame as JPEG
    other: Literal["round", "floor"] = "floor" if r.rounding == "round" else "round"
    alt = Preprocessor(dataclasses.replace(pre.spec, resize=dataclasses.replace(r, rounding=other)), frame)
    worst = 0.0
    for _label, sset, _tensors in sets:
        if sset.framework_inputs is None:
            continue
        for i, raw in enumerate(sset.raw):
            t = alt(raw)
            f = np.asarray(sset.framework_inputs[i])
            if f.size != t.size:
                return None
            worst = max(worst, float(np.max(np.abs(t.astype(np.float64) - f.reshape(t.shape).astype(np.float64)))))
            if worst > bound:
                return jpeg_explains(pre, frame.color, sets, bound)
    return f"preprocess.resize.rounding: {other} (with it the max abs is {worst:.4g}, within {bound:g})"


def _drift_hint(t: np.ndarray, f: np.ndarray, layout: str) -> str:
    """A guess at what differs, from the two tensors alone."""
    f = np.asarray(f, np.float64).reshape(t.shape)
    t = t.astype(np.float64)
    axis = {"nchw": -3, "ncw": -2, "nhwc": -1, "nwc": -1}.get(layout, -1)
    if t.ndim >= 3 and t.shape[axis] == 3:
        swapped = np.flip(t, axis=axis)
        if np.max(np.abs(swapped - f)) < 0.5 * np.max(np.abs(t - f)):
            return "the colour order looks swapped (preprocess.color rgb vs bgr)"
    diff = t - f
    if np.std(diff) < 0.05 * max(np.max(np.abs(diff)), 1e-12):
        return f"a constant offset of {float(np.mean(diff)):.4g}: check preprocess.mean"
    ratio = np.std(t) / max(np.std(f), 1e-12)
    if abs(ratio - 1) > 0.05:
        return f"the spread differs by a factor {ratio:.3g}: check preprocess.scale and std"
    return ("differences are spatial: check preprocess.resize (mode, interpolation, anchor, crop) against the "
            "framework's own transform")


def _build(spec: dict[str, Any], opts: CreateOptions, root: Path) -> None:
    post = postprocess_from_dict(spec["postprocess"])
    task = spec["task"]
    for key, given in (("preprocess.graph", opts.pre_graph), ("postprocess.graph", opts.post_graph)):
        if given is not None:  # copied as given: a stage is never quantised or rewritten
            dest = root / stage_files(spec)[key]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(given, dest)
    if opts.charset is not None and (rel := charset_file(spec)):  # bytes as given: a space line stays a space
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(opts.charset, root / rel)
    try:  # a state's .npy init is copied into the bundle and loaded
        extra_inputs = with_state_files(spec, opts.spec, root, inputs_from_list(spec.get("inputs")))
    except TypeError as exc:
        raise BundleError(f"{opts.spec}: key inputs: {reason_of(exc)}") from exc
    frame = frame_from_dict(spec["frame"], extra_inputs, str(opts.spec))
    # a pre graph opens once the model's input is known (_build_model); the vocabulary compiles here
    pre = None if opts.pre_graph is not None else Preprocessor(preprocess_from_dict(spec["preprocess"]), frame)
    sequence = any(x.kind == "state" for x in extra_inputs)

    model_path = opts.model
    frontend = None
    if spec.get("frontend"):
        # an audio front-end compiled to ONNX and merged before the model: the bundle takes raw samples
        import onnx

        from agent.bundle.frontends import frontend_from_dict, prepend_frontend

        frontend = frontend_from_dict(spec["frontend"], str(opts.spec))
        need_build_extra()
        model_path = root.parent / f".{root.name}.with-frontend.onnx"
        onnx.save(prepend_frontend(frontend, onnx.load(str(opts.model)), str(opts.spec), extra_inputs), str(model_path))
        log.info("bundle.create.frontend", **frontend.describe())
    try:
        from agent.bundle.model_build import build_model  # its steps use this module's helpers

        build_model(spec, opts, root, model_path, frontend, post, task, extra_inputs, frame, pre, sequence)
    finally:
        if model_path != opts.model:
            model_path.unlink(missing_ok=True)


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


BELOW_FLOOR_CHARS = 4000  # the manifest's below_floor text: what a report shows beside the variant


def _each_stage_first(problems: Sequence[str]) -> list[str]:
    """The problems with the first of each stage ("at stage build golden", "... held-out vs package", "... frame
    size 360x480") before the rest: the below_floor text is cut at BELOW_FLOOR_CHARS, and a long list of one
    stage's findings must not cut every other stage's out of it."""
    seen: set[str] = set()
    first: list[str] = []
    rest: list[str] = []
    for text in problems:
        m = re.search(r" at stage (.+?)(?: \(|$)", text)
        stage = m.group(1) if m else text
        (rest if stage in seen else first).append(text)
        seen.add(stage)
    return first + rest


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
        problem = f"variant {b.name}: " + "; ".join(_each_stage_first(problems))
        if not opts.keep_low_quality:
            raise QualityError(f"refusing the bundle: {problem}; pass --keep-low-quality to keep it marked "
                               f"below_floor (never selected unless the config pins it)")
        b.below_floor = problem[:BELOW_FLOOR_CHARS]
        log.warning("bundle.create.below_floor_kept", variant=b.name, problem=problem)


@dataclass
class GoldenStages:
    """The stage graphs' outputs on the golden samples, recorded per sample as the self-test's reproduction
    reference: `pre.geometry`, `post.<variant>.<output>` (post on each variant's outputs) and
    `post.reference.<output>` (post on the source's)."""

    pre: Any
    post: Any  # agent.proof.stages' post-processor: the vocabulary's or the graph's
    geometries: list[Any]
    pre_geometry: list[np.ndarray | None]
    axes: dict[str, int] = field(default_factory=dict)  # the outputs' batch axes (outputs.<name>.batch_axis)

    @classmethod
    def build(cls, root: Path, spec: Mapping[str, Any], pre: Any, golden: SampleSet, labels: Sequence[str],
              sequence: bool) -> "GoldenStages":
        from agent.proof.stages import GEOMETRY, GraphPostprocessor, GraphPreprocessor, VocabularyPostprocessor

        post_spec = postprocess_from_dict(spec["postprocess"])
        from agent.proof.stages import read_charset

        rel = charset_file(spec)
        charset = read_charset(root / rel) if rel else None
        post: Any = (GraphPostprocessor(root / post_spec.graph, post_spec, labels, charset) if post_spec.graph
                     else VocabularyPostprocessor(post_spec, labels))
        axes = spec_axes(spec)
        if sequence:
            return cls(pre, post, [], [], axes)
        geoms, pre_geometry = [], []
        for raw in golden.raw:
            if isinstance(pre, GraphPreprocessor):
                outs = pre.run(raw)
                pre_geometry.append(outs.get(GEOMETRY))
            else:
                pre_geometry.append(None)
            geoms.append(pre.geometry(raw))
        return cls(pre, post, geoms, pre_geometry, axes)

    def recorded(self, i: int, variants: Mapping[str, Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from agent.proof.stages import GraphPostprocessor

        out: dict[str, np.ndarray] = {}
        if i < len(self.pre_geometry) and self.pre_geometry[i] is not None:
            out["pre.geometry"] = np.asarray(self.pre_geometry[i])
        if isinstance(self.post, GraphPostprocessor) and self.geometries:
            for name, outs in [*variants.items(), ("reference", reference)]:
                tensors = self.post.tensors(split_batch(outs, 0, self.axes), self.geometries[i])
                out.update({f"post.{name}.{k}": np.asarray(v) for k, v in tensors.items()})
        return out


def golden_answers_text(golden: Path, samples: int) -> str | None:
    """The package's own answers of a golden set (`answers.json` beside a directory's frames, or an npz's
    `answers`), checked (kind, one result per sample, each readable by its kind), as the text the bundle keeps."""
    from agent.results.answers import has_answers, read_answers

    return read_answers(golden, samples).to_json() if has_answers(golden) else None


def check_answers_kind(spec: Mapping[str, Any], kind: str, where: object) -> None:
    """The package's answers (golden or held-out, at `where`) must be of the kind the bundle serves."""

    post = spec.get("postprocess") or {}
    serves = (post.get("result") or {}).get("kind") or vocabulary_kinds().get(post.get("type", ""))
    if serves is not None and serves != kind:
        key = "postprocess.result.kind" if (post.get("result") or {}).get("kind") else f"postprocess.type {post.get('type')}"
        raise BundleError(f"{where}: the package's answers are of kind {kind!r}, the bundle serves kind "
                          f"{serves!r} ({key}): give answers of the kind the bundle serves")


def check_against_answers(spec: Mapping[str, Any], stages: GoldenStages, fp32: Sequence[Mapping[str, np.ndarray]],
                          answers_text: str, samples: int, opts: CreateOptions, have_inputs: bool) -> None:
    """The FP32 model's FINAL result (pre stage -> model -> post stage -> kind) against the package's own answers,
    by the kind's metric, before quantisation: a wrong decoder (a YOLOX head declared as yolov5) is refused here
    naming the stage, metric, value, bound and sample; a golden set that cannot fail a metric is warned about."""
    from agent.proof.stage_proof import kind_floors
    from agent.results import kind_for
    from agent.results.answers import golden_warnings, read_answers

    answers = read_answers(json.loads(answers_text), samples, str(opts.golden))
    check_answers_kind(spec, answers.kind, opts.golden)
    kind = kind_for(answers.kind)
    for w in golden_warnings(answers):
        log.warning("bundle.create.golden_cannot_fail", kind=answers.kind, warning=w)
    served = [stages.post.decode(o, g, 0) for o, g in zip(fp32, stages.geometries)]
    floors = kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {})
    figures, findings = kind.fidelity(served, list(answers.results), floors, stage="post")
    log.info("bundle.create.answers_checked", kind=answers.kind, package=getattr(answers, "package", None),
             findings=len(findings))
    if findings:
        post_key = "postprocess.graph" if stages.post.stage_graph else "postprocess (type, layout, output)"
        pre_key = "preprocess.graph" if spec.get("preprocess", {}).get("graph") else "preprocess"
        where = (f"the pre stage reproduced the package's input tensors, so check {post_key}" if have_inputs else
                 f"check {post_key} (stage post) or {pre_key} (stage pre): give the package's input tensors "
                 "(`input` in the golden set) to tell them apart")
        raise BundleError(f"{opts.golden}: the FP32 model with this spec does not reproduce the package's own "
                          f"answers (before quantisation): " + "; ".join(f.text() for f in findings[:4]) + f"; {where}")


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


def size_extremes(frame: Any, golden: SampleSet) -> list[np.ndarray]:
    """For frames of any size: the first golden frame at the smallest and at the largest declared size
    (input.frame.min_size / max_size), the sizes a model must be calibrated and proven at."""
    if not getattr(frame, "any_size", False) or frame.max_size is None or not len(golden):
        return []
    import cv2

    base = golden.raw[0]
    out = []
    for h, w in (tuple(frame.min_size), tuple(frame.max_size)):
        img = cv2.resize(base, (int(w), int(h)), interpolation=cv2.INTER_LINEAR)
        out.append(img if img.ndim == base.ndim else img[..., None])
    return out


def judge_sizes(sess: Any, fp32: Any, frames: Sequence[np.ndarray], pre: Any, feeder: InputFeeder,
                spec: Mapping[str, Any], stages: GoldenStages, floors: Any) -> tuple[dict[str, Any], list[str]]:
    """A reduced-precision variant against FP32 on the frames of `size_extremes`, by the final result's kind (or
    the task's fidelity for raw outputs): an INT8 whose in-graph coordinates saturate beyond the calibrated
    size is refused naming the frame size, metric, value and bound."""
    from agent.proof.stage_proof import kind_floors

    post_spec = postprocess_from_dict(spec["postprocess"])
    kind_name = post_spec.result.kind if post_spec.result is not None else (
        None if post_spec.type == "raw" and post_spec.decision is None else vocabulary_kinds().get(post_spec.type))
    figures: dict[str, Any] = {}
    problems: list[str] = []
    for raw in frames:
        size = f"{raw.shape[1]}x{raw.shape[0]}"
        t = pre(raw)
        got, ref = (split_batch(_run_all(s, [t], feeder)[0], 0, spec_axes(spec)) for s in (sess, fp32))
        stage = f"build frame size {size} vs fp32"
        if kind_name is not None:
            from agent.results import kind_for

            kind = kind_for(kind_name)
            geometry = pre.geometry(raw)
            want = stages.post.decode(ref, geometry, 0)
            try:
                served = stages.post.decode(got, geometry, 0)
            except StageOutputError as exc:  # the variant fails at this size, not the build
                findings = [Finding("fidelity", "result the post stage serves", None, None, "post", None,
                                    f"{stage}: {exc}")]
            else:
                _figs, findings = kind.fidelity([served], [want],
                                                kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {}),
                                                stage=stage)
        else:  # the outputs the bundle uses only (postprocess.uses), as everywhere else
            q = judge_fidelity(post_spec, _used([got], post_spec.uses), _used([ref], post_spec.uses), floors, stage=stage)
            findings = list(q.findings)
            figures.update(_figures(f"size_{size}_", q))
        figures[f"size_{size}_findings"] = len(findings)
        problems += [f.text() for f in findings]
    return figures, problems


def judge_final_results(stages: GoldenStages, outs: Sequence[Mapping[str, np.ndarray]], geometries: Sequence[Any],
                        references: Sequence[Mapping[str, np.ndarray]], answers_text: str | None,
                        spec: Mapping[str, Any], stage: str) -> tuple[dict[str, float], list[Any]]:
    """A variant's final results (its outputs -> post stage -> kind) against the package's answers, or without
    them against the final results of the references' outputs, by the kind's fidelity: the gate the device applies."""
    from agent.proof.stage_proof import kind_floors
    from agent.results import kind_for

    post_spec = postprocess_from_dict(spec["postprocess"])
    if answers_text is not None:
        doc = json.loads(answers_text)
        name, want = doc["kind"], doc["results"]
    else:
        name = post_spec.result.kind if post_spec.result is not None else vocabulary_kinds().get(post_spec.type, "")
        want = []
        for i, (r, g) in enumerate(zip(references, geometries)):
            try:
                want.append(stages.post.decode(split_batch(r, 0, stages.axes), g, 0))
            except StageOutputError as exc:  # what every variant is judged against: the author's set is at fault
                raise BundleError(f"{stage}: the reference outputs of sample {i} (what every variant is judged "
                                  f"against) are refused by the post stage: {exc}") from exc
    kind = kind_for(name)
    served = []
    for i, (o, g) in enumerate(zip(outs, geometries)):
        try:
            served.append(stages.post.decode(split_batch(o, 0, stages.axes), g, 0))
        except StageOutputError as exc:  # this variant's outputs the post stage refuses: the variant fails, not the build
            return {}, [Finding("fidelity", "result the post stage serves", None, None, "post", i, f"{stage}: {exc}")]
    figures, findings = kind.fidelity(served, want, kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {}),
                                      stage=stage)
    return ({k: round(float(v), 6) for k, v in figures.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)}, list(findings))


def size_probe_arrays(frames: Sequence[np.ndarray], pre: Any, feeder: InputFeeder,
                      variants: Mapping[str, Path]) -> dict[str, np.ndarray]:
    """Golden arrays `size.<k>.raw` and `size.<k>.variant.<variant>.<output>`: each size-extreme frame and what
    every variant computed on it here (graph optimisation "all", as a device runs it), for the device's
    reproduction at the smallest and largest declared frame size."""
    out: dict[str, np.ndarray] = {}
    if not frames:
        return out
    tensors = [pre(f) for f in frames]
    for name, path in variants.items():
        sess = _cpu_session(path, optimize=True)
        for k, outs in enumerate(_run_all(sess, tensors, feeder)):
            out.update({f"size.{k}.variant.{name}.{o}": v for o, v in outs.items()})
    for k, f in enumerate(frames):
        out[f"size.{k}.raw"] = np.asarray(f)
    return out
