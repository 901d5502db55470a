"""The bundle manifest (bundle.yaml): parse, validate against the shipped JSON Schema, and type it.

Pure: takes the manifest text and a label for messages, returns frozen dataclasses or raises
BundleError naming the file and the key. File checks (hashes, contracts) live in `bundle`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from typing import Any, Literal, Mapping

import jsonschema
import yaml

from agent.errors import BundleError
from agent.fsio import load_yaml
from agent.vocabulary import kinds
from agent.vocabulary.jpeg_roundtrip import JpegRoundtrip
from agent.vocabulary.result_spec import ResultSpec, result_from_dict
from agent.vocabulary.jpeg_roundtrip import from_spec as jpeg_from_spec

MANIFEST_NAME = "bundle.yaml"
SIGNATURE_NAME = "bundle.sig"
FORMAT = 1
# p95 budget when a bundle states none: a fixed default, never one derived from a build machine's timing
# (a gate that follows what was measured cannot fail). Authors of bundles for known devices set theirs.
DEFAULT_LATENCY_BUDGET_MS = 1000.0

Precision = Literal["fp32", "fp16", "int8"]
# the vocabulary's tasks, and (a bundle with a postprocess graph) the result kinds: agent/vocabulary/kinds.py
Task = str
PostprocessType = Literal["classification", "detection", "segmentation", "raw", "graph"]
# a pre graph's optional output and a post graph's optional inputs besides the model outputs
GEOMETRY = "geometry"
FRAME_SIZE = "frame_size"
PRE_GRAPH_INPUT = "frame"
ResizeMode = Literal["stretch", "letterbox", "short_side_crop", "fit_multiple"]
DetectionLayout = Literal["boxes_scores", "yolov5", "yolov8", "end2end"]
Dim = int | str


def manifest_schema() -> dict[str, Any]:
    """The JSON Schema every manifest is validated against: agent/schema/bundle.schema.json, with the parts
    the result kinds declare (agent/vocabulary/kinds.py) filled in: `task`'s enum, `$defs/result`, and the kinds'
    floors under `selftest.fidelity`."""
    return _schema(kinds.generation())


@lru_cache(maxsize=4)
def _schema(generation: int) -> dict[str, Any]:
    text = resources.files("agent").joinpath("schema/bundle.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    schema["properties"]["task"]["enum"] = kinds.task_names()
    schema["$defs"]["result"] = kinds.result_schema(schema["$defs"]["result"]["description"])
    fidelity = schema["properties"]["selftest"]["properties"]["fidelity"]
    fidelity["properties"] = {**kinds.floor_schema(), **fidelity["properties"]}
    return schema


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[Dim, ...]
    # an output's batch axis (outputs[].batch_axis): 1 for a time-major [T, B, C] head; agent/vocabulary/batch_axis.py
    batch_axis: int = 0


@dataclass(frozen=True)
class FrameSpec:
    """The raw frame a source must deliver: an image (H, W, C uint8) or a sensor window (W, C)."""

    kind: Literal["image", "sensor"]
    height: int = 0
    width: int = 0
    channels: int = 3
    color: str = "rgb"
    window: int = 0
    dtype: str = "uint8"
    # sensor time: samples per second (None: windows are counted in samples only), samples between windows
    # (0: the window), and samples put before each stream's first sample (zero or a copy of the first one)
    sample_rate: float | None = None
    hop: int = 0
    padding: Literal["none", "zero", "replicate"] = "none"
    pad: int = 0
    # derived from the state inputs, never written: a stream silent longer than this in stream time
    # (arrival beyond the audio it already sent) starts again; a stateful bundle needs lossless hand-over
    reset_on_gap_s: float | None = None
    stateful: bool = False
    # image frames of any size (width or height 0): the bounds a source's frames must fall within, [h, w]
    min_size: tuple[int, int] = (1, 1)
    max_size: tuple[int, int] | None = None

    @property
    def any_size(self) -> bool:
        """An image frame whose size is not fixed: a pre graph or a resize takes each frame as it comes."""
        return self.kind == "image" and (self.height == 0 or self.width == 0)

    def size_problem(self, height: int, width: int) -> str | None:
        """Why a height x width image frame is outside what the bundle declares, or None."""
        if not self.any_size:
            return None
        lo, hi = self.min_size, self.max_size or (1 << 31, 1 << 31)
        fixed_h, fixed_w = self.height or None, self.width or None
        if fixed_h is not None and height != fixed_h or fixed_w is not None and width != fixed_w:
            return f"image frame size {width}x{height} is not the declared {self.width or 'any'}x{self.height or 'any'}"
        if not (lo[0] <= height <= hi[0] and lo[1] <= width <= hi[1]):
            return (f"image frame size {width}x{height} (h x w {height}x{width}) is outside input.frame.min_size "
                    f"{list(lo)} .. max_size {list(hi) if self.max_size else 'none'} (h, w)")
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.kind == "image":
            return (self.height, self.width, self.channels)
        return (self.window, self.channels)

    @property
    def step(self) -> int:
        """Samples between the starts of two windows of one stream."""
        return self.hop or self.window


SENSOR_TIME_KEYS = ("window_s", "hop_s")


def frame_from_dict(d: Mapping[str, Any], inputs: tuple["ExtraInput", ...] = (), where: str = MANIFEST_NAME) -> FrameSpec:
    """The `frame` block, with windows, hops and padding given in seconds turned into samples."""
    f = dict(d)
    if f.get("kind") == "sensor":  # the schema's default for samples (FrameSpec's own is an image's uint8)
        f.setdefault("dtype", "float32")
    rate = f.get("sample_rate")
    for key in SENSOR_TIME_KEYS:
        if key in f:
            if not rate:
                raise BundleError(f"{where}: key input.frame.{key}: a time in seconds needs frame.sample_rate")
            target = key[:-2]
            if f.get(target):
                raise BundleError(f"{where}: key input.frame.{key}: give {target} in samples or {key} in seconds, "
                                  "not both")
            f[target] = _samples(f.pop(key), rate, f"input.frame.{key}", where)
    if isinstance(f.get("padding"), Mapping):
        pad = dict(f.pop("padding"))
        f["padding"] = pad.get("mode", "zero")
        if ("seconds" in pad) == ("samples" in pad):  # neither: a declared padding of nothing; both: which?
            raise BundleError(f"{where}: key input.frame.padding: give samples or seconds (one of them), found "
                              f"{sorted(k for k in pad if k != 'mode') or 'neither'}")
        if "seconds" in pad:
            if not rate:
                raise BundleError(f"{where}: key input.frame.padding.seconds: a time in seconds needs frame.sample_rate")
            f["pad"] = _samples(pad["seconds"], rate, "input.frame.padding.seconds", where)
        else:
            f["pad"] = int(pad.get("samples", 0))
    gaps = [x.reset_on_gap_s for x in inputs if x.kind == "state" and x.reset_on_gap_s is not None]
    for key in ("min_size", "max_size"):
        if key in f:
            f[key] = tuple(f[key])
    return FrameSpec(**f, reset_on_gap_s=min(gaps) if gaps else None,
                     stateful=any(x.kind == "state" for x in inputs))


def _samples(seconds: float, rate: float, key: str, where: str) -> int:
    n = seconds * rate
    if abs(n - round(n)) > 1e-6 * max(1.0, n) or round(n) < 1:
        raise BundleError(f"{where}: key {key}: {seconds} s at {rate} samples/s is {n:g} samples, not a whole "
                          "number >= 1: give it in samples")
    return int(round(n))


@dataclass(frozen=True)
class ResizeSpec:
    """How a frame becomes the model's spatial size (see agent/vocabulary/preprocess.py for each mode).

    width/height: the output size (stretch, letterbox) or the crop size (short_side_crop); unused by
    fit_multiple, whose output size follows each frame (a dynamic-size input).
    """

    width: int = 0
    height: int = 0
    mode: ResizeMode = "stretch"
    interpolation: str = "linear"
    pad_value: int = 114
    anchor: Literal["center", "top_left"] = "center"
    short_side: int | None = None
    limit_side: int | None = None
    limit_type: Literal["max", "min"] = "max"
    multiple: int = 32
    resampler: Literal["opencv", "pil"] = "opencv"
    # short_side_crop conventions: torchvision (long side floor, crop offset round) is the default;
    # PaddleClas' ResizeImage/CropImage round the long side and floor the crop offset.
    size_rounding: Literal["floor", "round"] = "floor"
    crop_offset: Literal["round", "floor"] = "round"
    # letterbox: the resized side's length, round (OpenCV, Ultralytics) or floor (packages that int() it: YOLOX)
    rounding: Literal["round", "floor"] = "round"

    @property
    def fixed_size(self) -> bool:
        return self.mode != "fit_multiple"


@dataclass(frozen=True)
class PreprocessSpec:
    layout: str = ""  # "" with a graph: the graph makes the model's tensor
    dtype: str = "float32"
    graph: str | None = None  # a pre graph in the bundle (agent.proof.stages runs it)
    resize: ResizeSpec | None = None
    color: str | None = None
    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    source_drift: Mapping[str, Any] = field(default_factory=dict)
    # a JPEG encode and decode of each raw frame before the preprocessing (agent/vocabulary/jpeg_roundtrip.py)
    jpeg_roundtrip: JpegRoundtrip | None = None


MAX_RAW_VALUES = 4096  # values per output a raw result may carry: a summary, never the tensor


@dataclass(frozen=True)
class DecisionSpec:
    """A per-frame decision of the raw decoder: a threshold on one value, or the argmax over channels."""

    rule: Literal["threshold", "argmax"]
    output: str | None = None
    channel: int = 0
    threshold: float = 0.5
    labels: tuple[str, ...] = ()

    def label(self, class_id: int) -> str:
        return self.labels[class_id] if 0 <= class_id < len(self.labels) else str(class_id)


@dataclass(frozen=True)
class EventSpec:
    """Segments of one decision label in stream time: hysteresis, hangover and a minimum duration."""

    label: str
    off_threshold: float | None = None
    min_duration_s: float = 0.0
    hangover_s: float = 0.0


@dataclass(frozen=True)
class PostprocessSpec:
    type: PostprocessType = "graph"
    graph: str | None = None  # a post graph in the bundle (agent.proof.stages runs it)
    result: ResultSpec | None = None
    uses: tuple[str, ...] = ()  # the model outputs the bundle uses (empty: every output)
    # with a post graph: the model outputs' channel axis for reproduction (manifest key channel_axis; None: whole)
    stage_channel_axis: int | None = None
    output: str | None = None
    top_k: int = 5
    labels: str | None = None
    apply_softmax: bool = True
    boxes_output: str | None = None
    scores_output: str | None = None
    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    max_detections: int = 100
    outputs: tuple[str, ...] = ()
    layout: DetectionLayout = "boxes_scores"
    box_format: Literal["xyxy", "cxcywh"] = "xyxy"
    class_agnostic: bool = False
    channel: int = 0
    threshold: float = 0.3
    min_area: int = 16
    max_regions: int = 100
    mask: Literal["none", "rle"] = "none"
    min_score: float = 0.0  # segmentation: drop regions whose mean probability is lower (DBNet's box_thresh)
    unclip_ratio: float = 0.0  # segmentation: grow each box by area * ratio / perimeter (DBNet's unclip; 0 = off)
    # segmentation: a region's score is the map's mean over its own pixels, or over its bounding box
    # (DBNet's box_score_fast, which counts the low-probability pixels a box encloses)
    region_score: Literal["pixel_mean", "box_mean"] = "pixel_mean"
    dilation: int = 0  # segmentation: dilate the thresholded mask with a k x k kernel first (DBNet's use_dilation: 2)
    max_values: int = 64
    channel_axis: int = 1
    decision: DecisionSpec | None = None  # raw: publish a decision per frame
    events: EventSpec | None = None  # raw with a decision: segments of a label in stream time


@dataclass(frozen=True)
class ExtraInput:
    """A model input besides the frame: a constant, a state fed back from an output, or per-frame metadata."""

    name: str
    kind: Literal["constant", "state", "metadata"]
    dtype: str
    shape: tuple[Dim, ...]
    value: Any = None  # constant: a scalar or nested list
    init: float | str = 0.0  # state: a fill value, or a .npy in the bundle holding the tensor (bundle.state_files)
    from_output: str | None = None  # state: the output that feeds it on the next step
    reset_on_gap_s: float | None = None  # state: a gap longer than this starts a new stream
    default: Any = None  # metadata: value when a frame carries none


@dataclass(frozen=True)
class Variant:
    name: str
    file: str
    precision: Precision
    providers: tuple[str, ...]
    quality: Mapping[str, float | int | str] = field(default_factory=dict)
    quantization: Mapping[str, Any] = field(default_factory=dict)
    # what recorded this variant's own golden outputs (`variant.<name>.<output>`): onnxruntime, provider
    recorded: Mapping[str, str] = field(default_factory=dict)
    below_floor: str | None = None  # set by `bundle create --keep-low-quality`: never selected unless pinned
    # the variant's own output contract where quantisation changed dims (symbolic <-> concrete); else the manifest's
    outputs: tuple[TensorSpec, ...] = ()


@dataclass(frozen=True)
class ParityThresholds:
    max_abs: float | None = None
    max_rel: float | None = None
    min_cosine: float | None = None
    min_top1_agreement: float | None = None
    min_topk_agreement: float | None = None
    min_recall: float | None = None
    min_precision: float | None = None


@dataclass(frozen=True)
class SelftestSpec:
    latency_budget_ms: Mapping[str, float] = field(default_factory=dict)  # the author's; else the default
    parity: Mapping[str, ParityThresholds] = field(default_factory=dict)  # legacy, superseded; not judged
    # reproduction bounds overriding the code defaults: keys `<precision>` or `<precision>@<cpu|gpu|openvino>`
    reproduction: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    fidelity: Mapping[str, float] = field(default_factory=dict)  # the author's floors (per-task defaults otherwise)
    preprocess_max_abs: float = 1e-4
    # beyond preprocess_max_abs, a difference of at most this many 8-bit source levels per value with no channel
    # moved as a whole (agent.proof.pre_compare) is the device's image library rounding: allowed, said, and the
    # task judged on the device's own tensors; 0 refuses any difference over preprocess_max_abs
    preprocess_rounding_levels: float = 1.0
    min_accelerator_fraction: float = 0.9
    warmup_runs: int = 5
    latency_runs: int = 50

    def budget_for(self, provider: str) -> float:
        """The author's p95 budget for this provider, else theirs for the rest, else the default."""
        return self.latency_budget_ms.get(provider, self.latency_budget_ms.get("default", DEFAULT_LATENCY_BUDGET_MS))


@dataclass(frozen=True)
class Manifest:
    name: str
    version: int
    label: str
    created: str
    source: Mapping[str, str]
    task: Task
    input: TensorSpec
    frame: FrameSpec
    outputs: tuple[TensorSpec, ...]
    preprocess: PreprocessSpec
    postprocess: PostprocessSpec
    variants: tuple[Variant, ...]
    preference: Mapping[str, tuple[str, ...]]
    selftest: SelftestSpec
    golden: tuple[str, ...]
    files: Mapping[str, str]
    requires: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[ExtraInput, ...] = ()
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        known = ", ".join(v.name for v in self.variants)
        raise BundleError(f"bundle {self.name!r} has no variant {name!r} (variants: {known})")

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)

    @cached_property
    def batch_axes(self) -> dict[str, int]:
        """The outputs whose batch axis is not the first (outputs[].batch_axis), by name."""
        return {o.name: o.batch_axis for o in self.outputs if o.batch_axis}

    @property
    def input_names(self) -> tuple[str, ...]:
        """Every model input: the frame input first, then the declared extra inputs."""
        return (self.input.name, *(i.name for i in self.inputs))

    @property
    def stateful(self) -> bool:
        return any(i.kind == "state" for i in self.inputs)

    @property
    def stage_files(self) -> dict[str, str]:
        """The stage graphs this bundle ships, by stage ("pre", "post"): files like the variants."""
        out = {}
        if self.preprocess.graph is not None:
            out["pre"] = self.preprocess.graph
        if self.postprocess.graph is not None:
            out["post"] = self.postprocess.graph
        return out

    @property
    def used_outputs(self) -> tuple[str, ...]:
        """The model outputs the bundle uses (postprocess.uses; default every declared output)."""
        return self.postprocess.uses or self.output_names

    @cached_property
    def unused_outputs(self) -> frozenset[str]:
        """Declared outputs outside postprocess.uses: never judged nor served (undeclared ones, a state's, are
        not among them). Once per manifest: serving asks on every inference."""
        return frozenset(self.output_names) - frozenset(self.used_outputs)


def _key_path(path: Any) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in path]
    return "".join(parts).lstrip(".") or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    # oneOf failures are useless as-is ("not valid under any"); pick the branch whose
    # discriminator ('type' or 'kind') matches and report its first error instead.
    if error.validator == "oneOf" and isinstance(error.instance, dict):
        tag = error.instance.get("type", error.instance.get("kind"))
        branches = error.schema.get("oneOf", []) if isinstance(error.schema, dict) else []
        for k, branch in enumerate(branches):
            props = branch.get("properties", {}) if isinstance(branch, dict) else {}
            if tag is not None and any(isinstance(v, dict) and v.get("const") == tag for v in props.values()):
                own = [sub for sub in error.context or [] if sub.relative_schema_path and sub.relative_schema_path[0] == k]
                if own:  # the branch of this type: its own first error, not "unsupported type"
                    return _describe(min(own, key=lambda e: len(e.absolute_path)))
        for sub in error.context or []:
            branch_tag = sub.schema.get("properties", {}) if isinstance(sub.schema, dict) else {}
            if sub.validator == "const" or not isinstance(sub.schema, dict):
                continue
            consts = [p.get("const") for p in branch_tag.values() if isinstance(p, dict)]
            if tag is not None and tag in consts:
                return _describe(sub)
        if tag is not None:
            return f"key {_key_path(error.absolute_path)}: unsupported type {tag!r}"
        if error.context:  # no tag (a post graph's block): the branch that matched furthest names the key
            def fit(e: jsonschema.ValidationError) -> tuple[int, int]:
                known = e.schema.get("properties", {}) if isinstance(e.schema, dict) else {}
                return len(e.absolute_path), sum(k in known for k in error.instance)
            return _describe(max(error.context, key=fit))
    where = _key_path(error.absolute_path)
    if error.validator == "additionalProperties":
        return f"key {where}: {error.message} (unknown key)"
    return f"key {where}: {error.message}"


def parse_manifest(text: str, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest text; `where` names the file in every error."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise BundleError(f"{where}: malformed YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{where}: expected a mapping at the top level, found {type(data).__name__}")
    validator = jsonschema.Draft202012Validator(manifest_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = "; ".join(_describe(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise BundleError(f"{where}: schema check failed: {lines}{more}")
    manifest = _build(data, where)
    from agent.vocabulary.manifest_checks import check_semantics  # the checks read this module's types: imported here

    check_semantics(manifest, where)
    return manifest


def _tensor(d: Mapping[str, Any]) -> TensorSpec:
    return TensorSpec(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]), batch_axis=int(d.get("batch_axis", 0)))


def preprocess_from_dict(d: Mapping[str, Any], input_dtype: str | None = None) -> PreprocessSpec:
    pre = dict(d)
    if "graph" in pre and "dtype" not in pre and input_dtype is not None:
        pre["dtype"] = input_dtype
    resize = ResizeSpec(**pre.pop("resize")) if "resize" in pre else None
    if "jpeg_roundtrip" in pre:
        pre["jpeg_roundtrip"] = jpeg_from_spec(pre["jpeg_roundtrip"])
    return PreprocessSpec(resize=resize, mean=tuple(pre.pop("mean", ())), std=tuple(pre.pop("std", ())), **pre)


def inputs_from_list(items: Any) -> tuple[ExtraInput, ...]:
    return tuple(ExtraInput(**{**d, "shape": tuple(d["shape"])}) for d in (items or ()))


def postprocess_from_dict(d: Mapping[str, Any]) -> PostprocessSpec:
    post = dict(d)
    if "outputs" in post:
        post["outputs"] = tuple(post["outputs"])
    if "decision" in post:
        dec = dict(post["decision"])
        post["decision"] = DecisionSpec(**{**dec, "labels": tuple(dec.get("labels", ()))})
    if "events" in post:
        post["events"] = EventSpec(**post["events"])
    if "result" in post:
        post["result"] = result_from_dict(post["result"])
    if "uses" in post:
        post["uses"] = tuple(post["uses"])
    if "graph" in post and "channel_axis" in post:
        post["stage_channel_axis"] = post.pop("channel_axis")
    return PostprocessSpec(**post)


def _build(d: Mapping[str, Any], where: str = MANIFEST_NAME) -> Manifest:
    inp = d["input"]
    st = dict(d["selftest"])
    parity = {k: ParityThresholds(**v) for k, v in st.pop("parity", {}).items()}
    st["reproduction"] = {k: dict(v) for k, v in st.get("reproduction", {}).items()}
    st["fidelity"] = dict(st.get("fidelity", {}))
    return Manifest(
        name=d["name"],
        version=int(d["version"]),
        label=d["label"],
        created=str(d["created"]),
        source=dict(d["source"]),
        task=d["task"],
        input=_tensor(inp),
        frame=frame_from_dict(inp["frame"], inputs_from_list(d.get("inputs")), where),
        outputs=tuple(_tensor(o) for o in d["outputs"]),
        preprocess=preprocess_from_dict(d["preprocess"], inp.get("dtype")),
        postprocess=postprocess_from_dict(d["postprocess"]),
        variants=tuple(
            Variant(
                name=v["name"],
                file=v["file"],
                precision=v["precision"],
                providers=tuple(v["providers"]),
                quality=dict(v.get("quality", {})),
                quantization=dict(v.get("quantization", {})),
                recorded=dict(v.get("recorded", {})),
                below_floor=v.get("below_floor"),
                outputs=tuple(_tensor(o) for o in v.get("outputs", ())),
            )
            for v in d["variants"]
        ),
        preference={k: tuple(v) for k, v in d.get("preference", {}).items()},
        selftest=SelftestSpec(parity=parity, **st),
        golden=tuple(d["golden"]),
        files=dict(d["files"]),
        requires=dict(d.get("requires", {})),
        inputs=inputs_from_list(d.get("inputs")),
        raw=d,
    )

