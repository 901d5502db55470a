"""`bundle create`'s inputs: its options and the author's spec, read (stage graphs and charset named) and checked
against the manifest schema, then against the model's own tensors, before anything slow starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from agent.bundle.quantise import reason_of
from agent.errors import BundleError
from agent.proof.terms import CPU
from agent.vocabulary.manifest import inputs_from_list, postprocess_from_dict

Method = Literal["minmax", "entropy", "percentile"]


SPEC_KEYS = {"name", "version", "label", "task", "frame", "preprocess", "postprocess", "selftest", "preference", "source",
             "inputs", "frontend", "outputs"}


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
