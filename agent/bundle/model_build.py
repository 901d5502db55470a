"""`bundle create`'s model build as named steps over one `_Build` value: check the model and its stages against
the spec, load the sample sets, the spec's preprocessing against the package's own tensors, the reference outputs,
the stages and the package's answers (before anything quantises), the variants made and each judged, the quality
gate, the golden samples and the manifest written. The helpers each step calls live in the build's
modules: build_spec, build_runs, pre_drift, variant_judges, quantise.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from agent.bundle.build_runs import (
    PROVIDERS_BY_PRECISION,
    VariantBuild,
    _as_batch,
    _cpu_session,
    _Extended,
    _figures,
    _latency_ms,
    _ort_version,
    _Prepared,
    _run_all,
    _source,
    _top1,
    _unbatch,
    _used,
    ort_view,
    prepare_fp32,
    variant_outputs,
)
from agent.bundle.build_spec import CreateOptions, provisional_manifest, stage_files, validate_against_model
from agent.bundle.decoder_proof import unproven_decoder
from agent.bundle.load import ANSWERS_FILE, golden_arrays, hash_files
from agent.bundle.pre_drift import DEFAULT_PREPROCESS_DRIFT, check_preprocess_drift, explaining_key
from agent.bundle.quantise import CalibrationFeeds, convert_fp16, prequantized, quantize_int8, reason_of
from agent.bundle.samples import SampleSet, load_samples
from agent.bundle.variant_judges import (
    GoldenStages,
    _quality_gate,
    check_against_answers,
    check_answers_kind,
    golden_answers_text,
    judge_final_results,
    judge_sizes,
    size_extremes,
    size_probe_arrays,
)
from agent.errors import BundleError
from agent.logsetup import get_logger
from agent.proof.parity import fidelity_floors, judge_fidelity
from agent.proof.terms import CPU
from agent.vocabulary.batch_axis import check_single_sample_outputs, spec_batch_axes
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.manifest import MANIFEST_NAME, ExtraInput, TensorSpec, preprocess_from_dict

log = get_logger("bundle.create")  # the build's events keep the command's logger


@dataclass
class _Build:
    """One `bundle create`'s model build: its inputs, and what each named step adds for the next."""

    spec: dict[str, Any]
    opts: CreateOptions
    root: Path
    model_path: Path
    frontend: Any
    post: Any
    task: str
    extra_inputs: tuple[ExtraInput, ...]
    frame: Any
    pre: Any
    sequence: bool
    # _check_model
    already: Any = None  # a prequantized graph's quantisation facts, or None
    fp32_file: str = "model_fp32.onnx"
    input_spec: dict[str, Any] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    fp32_ref_sess: Any = None
    feeder: Any = None
    # _load_sets
    calib_set: Any = None
    golden_set: Any = None
    held: Any = None
    golden_inputs: list[np.ndarray] = field(default_factory=list)
    held_inputs: list[np.ndarray] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    axes: dict[str, int] = field(default_factory=dict)
    # _check_source_drift, _references, _check_stages
    source_drift: dict[str, Any] | None = None
    ort_ref: list[dict[str, np.ndarray]] = field(default_factory=list)
    references: list[dict[str, np.ndarray]] = field(default_factory=list)
    source_check: dict[str, Any] = field(default_factory=dict)
    reference_origin: str = ""
    stages: Any = None
    answers_text: str | None = None
    held_answers: str | None = None
    unproven: Any = None
    # _make_variants, _judge_variants
    builds: list[VariantBuild] = field(default_factory=list)
    extremes: list[Any] = field(default_factory=list)
    own: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)  # each variant's own golden outputs

    def prepare(self, raw: np.ndarray) -> np.ndarray:
        """A frame -> [1, ...]; a stateful model's sequence -> [T, 1, ...]."""
        try:
            return np.stack([self.pre(r) for r in raw]) if self.sequence else self.pre(raw)
        except Exception as exc:
            raise BundleError(f"preprocessing a sample failed: {reason_of(exc)}") from exc


def build_model(spec: dict[str, Any], opts: CreateOptions, root: Path, model_path: Path, frontend: Any, post: Any,
                 task: str, extra_inputs: tuple[ExtraInput, ...], frame: Any, pre: Any, sequence: bool) -> None:
    """The model's build, as named steps: check the model and its stages against the spec; load the sample sets;
    the spec's preprocessing against the package's own tensors; the reference outputs; the stages and the
    package's answers (before anything quantises); the variants made, then each judged; the quality gate; the
    golden samples and the manifest written."""
    b = _Build(spec, opts, root, model_path, frontend, post, task, extra_inputs, frame, pre, sequence)
    _check_model(b)
    _load_sets(b)
    _check_source_drift(b)
    _references(b)
    _check_stages(b)
    _make_variants(b)
    _judge_variants(b)
    _quality_gate(b.builds, task, opts)
    _write_bundle(b, _write_golden(b))


def _check_model(b: _Build) -> None:
    """The FP32 graph prepared and read as ONNX Runtime serves it; the spec, the pre stage and the stage graphs'
    contracts checked against its real tensors, before any sample loads."""
    spec, opts, root = b.spec, b.opts, b.root
    b.already = prequantized(b.model_path)
    # an already-quantised graph is served as it is: its int8 variant, never quantised again
    b.fp32_file = "model_int8.onnx" if b.already else "model_fp32.onnx"
    input_spec, outputs, opset = prepare_fp32(b.model_path, root / b.fp32_file, [x.name for x in b.extra_inputs])
    # the contract as ONNX Runtime serves the graph (CPU, no optimisation: the view the device's contract
    # check opens), so dims the graph leaves symbolic and ORT resolves never refuse the build's own variants;
    # the same session is the FP32 reference below
    b.fp32_ref_sess = _cpu_session(root / b.fp32_file, optimize=False)
    b.input_spec = input_spec = ort_view(b.fp32_ref_sess, [input_spec], "input", b.model_path)[0]
    b.outputs = outputs = ort_view(b.fp32_ref_sess, outputs, "output", b.model_path)
    log.info("bundle.create.model_checked", opset=opset, input=input_spec, outputs=[o["name"] for o in outputs],
             extra_inputs=[x.name for x in b.extra_inputs], prequantized=b.already or None)
    validate_against_model(spec, input_spec, outputs, str(opts.spec))
    if b.pre is None:
        from agent.proof.stages import GraphPreprocessor

        b.pre = GraphPreprocessor(root / spec["preprocess"]["graph"], b.frame,
                                  preprocess_from_dict(spec["preprocess"], input_spec["dtype"]),
                                  TensorSpec(input_spec["name"], input_spec["dtype"], tuple(input_spec["shape"])))
    if stage_files(spec):  # each stage graph's I/O against the model's real tensors, before samples load
        from agent.bundle.load import check_stage_contracts
        from agent.vocabulary.manifest import parse_manifest

        check_stage_contracts(root, parse_manifest(yaml.safe_dump(provisional_manifest(spec, input_spec, outputs)),
                                                   str(opts.spec)))
    b.feeder = InputFeeder(input_spec["name"], b.extra_inputs)
    if b.pre.spec.dtype != input_spec["dtype"]:
        raise BundleError(f"{opts.spec}: key preprocess.dtype: {b.pre.spec.dtype}, but the model's input "
                          f"{input_spec['name']!r} takes {input_spec['dtype']}")


def _load_sets(b: _Build) -> None:
    """The calibration (lazily), golden and held-out sets, the golden and held-out frames preprocessed, and the
    outputs' batch axes."""
    opts, frame = b.opts, b.frame
    b.calib_set = load_samples(opts.calibration, frame, limit=opts.calibration_limit, lazy=True)
    b.golden_set = load_samples(opts.golden, frame)
    b.held = load_samples(opts.heldout, frame) if opts.heldout else None
    log.info("bundle.create.samples", calibration=len(b.calib_set), golden=len(b.golden_set),
             heldout=len(b.held) if b.held else 0, sequences=b.sequence)
    b.golden_inputs = [b.prepare(r) for r in b.golden_set.raw]
    b.held_inputs = [b.prepare(r) for r in b.held.raw] if b.held else []
    b.output_names = [o["name"] for o in b.outputs]
    b.axes = spec_batch_axes(b.spec, b.outputs, opts.spec)  # outputs[].batch_axis: time-major heads on their axis
    if b.axes and b.sequence:  # a stateful model's steps are sliced [T, 1, ...] on their own: not both
        raise BundleError(f"{opts.spec}: key outputs.{next(iter(b.axes))}.batch_axis: not supported for a stateful "
                          "model (its sequences are [T, 1, ...] per step); re-export the state model batch-first")


def _check_source_drift(b: _Build) -> None:
    """The spec must reproduce the framework's own input tensors wherever the author gave them."""
    opts = b.opts
    drift_sets: list[tuple[str, SampleSet, Sequence[np.ndarray]]] = [("golden", b.golden_set, b.golden_inputs)]
    if b.held is not None:
        drift_sets.append(("heldout", b.held, b.held_inputs))
    if b.calib_set.framework_inputs is not None:
        drift_sets.append(("calibration", b.calib_set, _Prepared(b.calib_set.raw, b.prepare)))
    bound = DEFAULT_PREPROCESS_DRIFT if opts.allow_preprocess_drift is None else opts.allow_preprocess_drift
    try:
        source_drift = check_preprocess_drift(drift_sets, b.pre.spec.layout, bound,
                                              "preprocess.graph" if opts.pre_graph is not None else None)
    except BundleError as exc:
        if (key := explaining_key(b.pre, b.frame, drift_sets, bound)) is not None:
            raise BundleError(f"{exc}. The key that explains it: {key}") from exc
        raise
    if source_drift:
        source_drift["accepted_by_author"] = opts.allow_preprocess_drift is not None
        log.info("bundle.create.preprocess_drift", **source_drift)
    b.source_drift = source_drift


def _references(b: _Build) -> None:
    """Reference outputs: the source framework's when given, else FP32 on CPU with no graph optimisation."""
    b.ort_ref = ort_ref = _run_all(b.fp32_ref_sess, b.golden_inputs, b.feeder)
    if not b.sequence and ort_ref:  # one frame's outputs have one sample on each batch axis (time-major heads)
        check_single_sample_outputs({k: v for k, v in ort_ref[0].items() if not b.post.uses or k in b.post.uses},
                                    b.axes, b.opts.spec)
    golden, names = b.golden_set, b.output_names
    if golden.references:
        missing = [n for n in names if n not in golden.references]
        if missing:
            raise BundleError(f"{b.opts.golden}: reference outputs missing for {missing}")
        b.references = [{n: _as_batch(golden.references[n][i], ort_ref[i][n]) for n in names}
                        for i in range(len(golden))]
        diff = max(float(np.max(np.abs(ort_ref[i][n] - b.references[i][n]))) for i in range(len(b.references))
                   for n in names)
        b.source_check = {"golden_max_abs_vs_source": float(f"{diff:.3g}")}
        b.reference_origin = "source framework"
    else:
        b.references = ort_ref
        b.reference_origin = "onnxruntime CPU fp32, optimisations disabled"


def _check_stages(b: _Build) -> None:
    """The stages and the package's own answers, before anything quantises: a wrong pre or post stage is refused
    in seconds, naming the stage, not after calibration (and never proven "against itself" on the device)."""
    opts, held, golden = b.opts, b.held, b.golden_set
    labels_list = [x for x in Path(opts.labels).read_text().splitlines() if x.strip()] if opts.labels else []
    b.stages = GoldenStages.build(b.root, b.spec, b.pre, golden, labels_list, b.sequence)
    b.answers_text = golden_answers_text(opts.golden, len(golden))
    if b.answers_text is not None and not b.sequence:
        check_against_answers(b.spec, b.stages, [split_batch(o, 0, b.axes) for o in b.ort_ref], b.answers_text,
                              len(golden), opts, golden.framework_inputs is not None)
    # the package's own answers on the held-out set: every variant's final result is judged on them; answers
    # of another kind than the bundle serves are the author's mistake, refused here (not each variant's, later)
    b.held_answers = (golden_answers_text(opts.heldout, len(held))
                      if held is not None and opts.heldout is not None and not b.sequence else None)
    if b.held_answers is not None:
        check_answers_kind(b.spec, json.loads(b.held_answers)["kind"], opts.heldout)
    b.unproven = unproven_decoder(b.spec, opts.golden, opts.heldout if held is not None else None,
                                  b.answers_text is not None, b.held_answers is not None,
                                  opts.allow_unproven_decoder, b.sequence)


def _make_variants(b: _Build) -> None:
    """FP32 (or the prequantized graph as it is), INT8 calibrated on the calibration set, FP16."""
    opts, root = b.opts, b.root
    if b.already:
        b.builds = [VariantBuild("int8", "int8", b.fp32_file, dict(b.source_check),
                                 quantization={"format": "prequantized", **b.already})]
        log.info("bundle.create.prequantized", kept_as="int8", **b.already)
    else:
        b.builds = [VariantBuild("fp32", "fp32", b.fp32_file, dict(b.source_check))]
    b.extremes = [] if b.sequence else size_extremes(b.frame, b.golden_set)
    if opts.int8 and not b.already:
        log.info("bundle.create.quantizing", method=opts.method, per_channel=opts.per_channel,
                 samples=len(b.calib_set))
        dynamic_batch = not isinstance(b.input_spec["shape"][0], int) and b.pre.fixed_size and not b.sequence
        # frames of any size: calibrated at the smallest and the largest declared size too, so coordinates the
        # graph computes from the frame's size are never clipped to the range the sample set happened to hold
        calib = CalibrationFeeds(_Extended(b.calib_set.raw, b.extremes), b.pre, b.feeder,
                                 opts.calibration_batch if dynamic_batch else 1,
                                 fp32=b.fp32_ref_sess if b.sequence else None)
        q = quantize_int8(root / b.fp32_file, root / "model_int8.onnx", calib, opts)
        b.builds.append(VariantBuild("int8", "int8", "model_int8.onnx", quantization=q))
    if opts.fp16 and not b.already:
        b.builds.append(VariantBuild("fp16", "fp16", "model_fp16.onnx",
                                     quantization=convert_fp16(root / b.fp32_file, root / "model_fp16.onnx")))


def _held_references(b: _Build) -> tuple[list[dict[str, np.ndarray]], str]:
    """What the held-out set is judged against: the author's own references (every variant, FP32 too), else FP32."""
    held, names = b.held, b.output_names
    if held is None:
        return [], "fp32"
    held_ref = _run_all(_cpu_session(b.root / b.fp32_file, optimize=True), b.held_inputs, b.feeder)
    if not held.references:
        return held_ref, "fp32"
    missing = [n for n in names if n not in held.references]
    if missing:
        raise BundleError(f"{b.opts.heldout}: reference outputs missing for {missing}")
    return [{n: _as_batch(held.references[n][i], held_ref[i][n]) for n in names} for i in range(len(held))], "source"


def _judge_variants(b: _Build) -> None:
    """Each variant run as a device runs it (graph optimisation "all") and judged on the golden and held-out
    sets, its figures and problems recorded for the quality gate."""
    held_ref, held_vs = _held_references(b)
    floors = fidelity_floors(b.task, (b.spec.get("selftest") or {}).get("fidelity"))
    for v in b.builds:
        if v is not b.builds[0]:  # before its evaluation: a contract quantisation changed is recorded or refused now
            v.outputs = variant_outputs(_cpu_session(b.root / v.file, optimize=False), b.outputs, v.name,
                                        b.root / v.file)
        sess = _cpu_session(b.root / v.file, optimize=True)  # as a device runs it: graph optimisation "all"
        b.own[v.name] = _run_all(sess, b.golden_inputs, b.feeder)
        v.recorded = {"onnxruntime": _ort_version(), "provider": CPU, "graph_optimization": "all"}
        problems = _judge_golden(b, v, floors)
        if b.held:
            problems += _judge_held(b, v, sess, held_ref, held_vs, floors)
        b.feeder.reset("")
        v.quality.update(_latency_ms(sess, b.feeder.feeds(b.golden_inputs[0][0] if b.sequence else b.golden_inputs[0])))
        v.quality["size_bytes"] = (b.root / v.file).stat().st_size
        if b.extremes and v is not b.builds[0]:
            figures, more = judge_sizes(sess, b.fp32_ref_sess, b.extremes, b.pre, b.feeder, b.spec, b.stages, floors)
            v.quality.update(figures)
            problems += more
        v.problems = problems


def _judge_golden(b: _Build, v: VariantBuild, floors: Any) -> list[str]:
    post, sequence = b.post, b.sequence
    # the outputs the bundle uses (postprocess.uses) only: the rest are never judged, here as on the device
    g = judge_fidelity(post, _used(_unbatch(b.own[v.name], sequence, b.axes), post.uses),
                       _used(_unbatch(b.references, sequence, b.axes), post.uses), floors, stage="build golden")
    v.quality.update(_figures("golden_", g))
    # a post graph's variant is gated by its final result's kind (as the device judges it), its raw outputs'
    # figures kept for the record; with the package's answers every variant's final result is judged on them
    problems = [] if post.graph is not None else [f.text() for f in g.findings]
    if not sequence and (b.answers_text is not None or post.graph is not None):
        figures, findings = judge_final_results(b.stages, b.own[v.name], b.stages.geometries,
                                                b.references, b.answers_text, b.spec, "build golden")
        v.quality.update({f"golden_final_{k}": x for k, x in figures.items()})
        problems += [f.text() for f in findings]
    return problems


def _judge_held(b: _Build, v: VariantBuild, sess: Any, held_ref: list[dict[str, np.ndarray]], held_vs: str,
                floors: Any) -> list[str]:
    post, sequence, held = b.post, b.sequence, b.held
    log.info("bundle.create.evaluating", variant=v.name, heldout=len(held))
    outs = _run_all(sess, b.held_inputs, b.feeder)
    h = judge_fidelity(post, _used(_unbatch(outs, sequence, b.axes), post.uses),
                       _used(_unbatch(held_ref, sequence, b.axes), post.uses), floors,
                       stage=f"build held-out vs {held_vs}")
    v.quality.update(_figures("heldout_", h))
    v.quality["heldout_samples"] = len(held)
    held_geoms = [b.pre.geometry(r) for r in held.raw] if not sequence else []
    problems: list[str] = []
    if post.graph is None:
        problems += [f.text() for f in h.findings]
    elif not sequence:
        figures, findings = judge_final_results(b.stages, outs, held_geoms, held_ref, None, b.spec,
                                                f"build held-out vs {held_vs}")
        v.quality.update({f"heldout_final_{k}": x for k, x in figures.items()})
        problems += [f.text() for f in findings]
    if b.held_answers is not None:
        figures, findings = judge_final_results(b.stages, outs, held_geoms, held_ref, b.held_answers, b.spec,
                                                "build held-out vs package")
        v.quality.update({f"heldout_package_{k}": x for k, x in figures.items()})
        problems += [f.text() for f in findings]
    if held.labels is not None and b.task == "classification" and not sequence:
        cls_out = post.output or b.output_names[0]
        v.quality["heldout_top1"] = round(float(np.mean(_top1(outs, cls_out, post).ravel() == held.labels)), 5)
    return problems


def _write_golden(b: _Build) -> list[str]:
    """The golden samples with every variant's own outputs and the stages' recordings; the package's answers."""
    root, builds, names = b.root, b.builds, b.output_names
    golden_files = []
    (root / "golden").mkdir()
    if b.answers_text is not None:
        (root / ANSWERS_FILE).write_text(b.answers_text)
    for i, (raw, t, ref) in enumerate(zip(b.golden_set.raw, b.golden_inputs, b.references)):
        rel = f"golden/sample_{i:03d}.npz"
        framework = None if b.golden_set.framework_inputs is None else b.golden_set.framework_inputs[i]
        arrays = golden_arrays(raw, t, {n: ref[n] for n in names}, framework)
        arrays.update({f"variant.{v.name}.{n}": b.own[v.name][i][n] for v in builds for n in names})
        arrays.update(b.stages.recorded(i, {v.name: b.own[v.name][i] for v in builds}, ref))
        if i == 0:  # the frames at the declared size extremes, with each variant's outputs: proven on the device too
            arrays.update(size_probe_arrays(b.extremes, b.pre, b.feeder, {v.name: root / v.file for v in builds}))
        np.savez_compressed(root / rel, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        golden_files.append(rel)
    return golden_files


def _write_bundle(b: _Build, golden_files: list[str]) -> None:
    """The labels and the manifest, every file hashed."""
    spec, opts, root = b.spec, b.opts, b.root
    labels_rel = None
    if opts.labels:
        labels_rel = "labels.txt"
        shutil.copyfile(opts.labels, root / labels_rel)
    postprocess = dict(spec["postprocess"])
    if labels_rel:
        postprocess["labels"] = labels_rel
    # The author's floors and bounds pass through unchanged: a build never writes a gate from what it measured.
    # No latency budget is derived from the build machine's timing either: without the author's
    # `latency_budget_ms` the device applies DEFAULT_LATENCY_BUDGET_MS (vocabulary/manifest.py).
    selftest = dict(spec.get("selftest", {}))
    preference = spec.get("preference") or {CPU: [v.name for v in b.builds
                                                  if CPU in PROVIDERS_BY_PRECISION[v.precision]]}
    frontend = b.frontend
    manifest: dict[str, Any] = {
        "format": 1,
        "name": spec["name"],
        "version": int(spec["version"]),
        "label": str(spec.get("label", "0.1.0")),
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "source": _source(spec.get("source", {}), opts.model, b.reference_origin
                          + (f"; front-end compiled into the graph: {frontend.describe()}" if frontend else ""))
        | ({"unproven_decoder": b.unproven} if b.unproven else {}),
        "task": b.task,
        "input": {**b.input_spec, "frame": spec["frame"]},
        **({"inputs": spec["inputs"]} if spec.get("inputs") else {}),
        "outputs": b.outputs,
        "preprocess": {**spec["preprocess"], **({"source_drift": b.source_drift} if b.source_drift else {})},
        "postprocess": postprocess,
        "variants": [
            {"name": v.name, "file": v.file, "precision": v.precision,
             "providers": PROVIDERS_BY_PRECISION[v.precision], "quality": v.quality,
             **({"quantization": v.quantization} if v.quantization else {}),
             "recorded": v.recorded, **({"below_floor": v.below_floor} if v.below_floor else {}),
             **({"outputs": v.outputs} if v.outputs else {})}
            for v in b.builds
        ],
        "preference": preference,
        "selftest": selftest,
        "golden": golden_files,
        "files": {},
    }
    manifest["files"] = hash_files(root)
    (root / MANIFEST_NAME).write_text(yaml.safe_dump(manifest, sort_keys=False, width=120))
