"""Stage graphs: a bundle's pre and post ONNX graphs, each run in its own ONNX Runtime session on the CPU provider.

Serving, the self-test and `bundle create` take pre- and postprocessing from `preprocessor_for` and
`postprocessor_for`, so the declarative vocabulary and a graph are one interface to them. No Python travels in a
bundle: a stage is an ONNX file listed in the manifest's `files`, hashed and signed like a variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import onnxruntime as ort

from agent.bundle.load import Bundle
from agent.errors import BundleError, PreprocessError, StageOutputError
from agent.vocabulary.decoders import check_result_size, decode
from agent.vocabulary.manifest import (
    FRAME_SIZE,
    GEOMETRY,
    PRE_GRAPH_INPUT,
    FrameSpec,
    PostprocessSpec,
    PreprocessSpec,
    ResultSpec,
    TensorSpec,
)
from agent.vocabulary.preprocess import IDENTITY, Geometry, Preprocessor
from agent.proof.terms import CPU

GEOMETRY_VALUES = 6  # scale_x, scale_y, pad_x, pad_y, crop_x, crop_y (agent.vocabulary.preprocess.Geometry)


def stage_session(path: Path, stage: str, threads: int = 1) -> ort.InferenceSession:
    """A stage's own session: CPU provider, one intra-op thread (stages run in the pools' many workers)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), so, providers=[CPU])
    except Exception as exc:  # ORT raises several unrelated types for a bad model file
        raise BundleError(f"{path}: ONNX Runtime cannot load the {stage} graph: {' '.join(str(exc).split())[:300]}") from exc


def input_size(tensor: np.ndarray) -> tuple[int, int] | None:
    """(width, height) of a pre graph's image tensor [1, C, H, W] or [1, H, W, C] (channels 1, 3 or 4), or None."""
    if tensor.ndim != 4:
        return None
    if tensor.shape[3] in (1, 3, 4) and tensor.shape[1] not in (1, 3, 4):
        return int(tensor.shape[2]), int(tensor.shape[1])
    return int(tensor.shape[3]), int(tensor.shape[2])


def geometry_of(values: np.ndarray | None, height: int, width: int,
                size: tuple[int, int] | None = None) -> Geometry:
    """A pre graph's `geometry` output [6] as the Geometry that maps result coordinates back to the frame; `size`,
    the model input's (width, height), lets a decoder scale a strided map to input pixels."""
    if values is None:
        return Geometry(1.0, 1.0, 0.0, 0.0, frame_w=width, frame_h=height, input_w=width, input_h=height)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size != GEOMETRY_VALUES or not np.all(np.isfinite(v)) or v[0] <= 0 or v[1] <= 0:
        raise PreprocessError(f"stage pre: output {GEOMETRY!r} is {v.tolist()}: expected {GEOMETRY_VALUES} finite values "
                              "(scale_x > 0, scale_y > 0, pad_x, pad_y, crop_x, crop_y)")
    in_w, in_h = size or (0, 0)
    return Geometry(float(v[0]), float(v[1]), float(v[2]), float(v[3]), float(v[4]), float(v[5]),
                    frame_w=width, frame_h=height, input_w=in_w, input_h=in_h)


def geometry_values(g: Geometry) -> np.ndarray:
    """The [6] float32 a post graph takes as `geometry`."""
    return np.array([g.scale_x, g.scale_y, g.pad_x, g.pad_y, g.crop_x, g.crop_y], dtype=np.float32)


def pre_fixed_size(model_input_shape: Sequence[Any]) -> bool:
    """A pre graph makes tensors of one shape (frames may share a batch) when the model's input fixes it."""
    return all(isinstance(d, int) for d in model_input_shape[1:])


class StageWatch(Protocol):
    """What covers a stage's runs while serving (agent.service.serving_ledger.ServingWatch): a native crash
    inside the stage's session is charged to the stage, never to the model candidate that was not running."""

    def before(self) -> None: ...
    def after(self, outputs: dict[str, Any]) -> dict[str, Any]: ...


def _watched_run(session: ort.InferenceSession, watch: StageWatch | None, names: list[str],
                 feeds: dict[str, np.ndarray]) -> list[Any]:
    if watch is None:
        return session.run(names, feeds)
    watch.before()
    try:
        return session.run(names, feeds)
    finally:
        watch.after({})


class GraphPreprocessor:
    """`preprocess.graph`: raw frame (uint8 H x W x C of any size within the frame's bounds, or a sensor window
    [window, channels]) -> the model's frame input with a batch axis of 1, and the geometry of the graph's
    `geometry` output (identity for a window). Same interface as agent.vocabulary.preprocess.Preprocessor."""

    def __init__(self, path: Path, frame: FrameSpec, spec: PreprocessSpec, model_input: TensorSpec):
        self.frame = frame
        self.spec = spec
        self.path = path
        self.session = stage_session(path, "pre")
        self.output_name = model_input.name
        names = [o.name for o in self.session.get_outputs()]
        self._wanted = [self.output_name] + ([GEOMETRY] if GEOMETRY in names else [])
        self._rank = len(model_input.shape)
        self._fixed_dims = {i: d for i, d in enumerate(model_input.shape) if i > 0 and isinstance(d, int)}
        # frames share a batch only when every frame makes a tensor of one shape: the model's input fixes it
        self.fixed_size = pre_fixed_size(model_input.shape)
        self.watch: StageWatch | None = None  # set while serving (agent.service.boot)

    def check(self, raw: np.ndarray) -> None:
        f = self.frame
        if not isinstance(raw, np.ndarray):
            raise PreprocessError(f"expected a numpy array frame, got {type(raw).__name__}")
        if f.kind == "sensor":
            if raw.shape != (f.window, f.channels):
                raise PreprocessError(f"sensor window shape {raw.shape} is not ({f.window}, {f.channels})")
            return
        if raw.ndim == 2 and f.channels == 1:
            return self.check(raw[:, :, None])
        if raw.ndim != 3 or raw.shape[2] != f.channels:
            raise PreprocessError(f"image frame shape {raw.shape} does not have {f.channels} channel(s) "
                                  f"(expected HxWx{f.channels})")
        if raw.dtype != np.uint8:
            raise PreprocessError(f"image frame dtype {raw.dtype} is not uint8")
        if raw.shape[0] == 0 or raw.shape[1] == 0:
            raise PreprocessError(f"empty image frame {raw.shape}")
        if not f.any_size and raw.shape[:2] != (f.height, f.width):
            raise PreprocessError(f"image frame size {raw.shape[1]}x{raw.shape[0]} is not the declared "
                                  f"{f.width}x{f.height} (input.frame; width/height 0 with max_size take any size)")
        if (why := f.size_problem(raw.shape[0], raw.shape[1])) is not None:
            raise PreprocessError(why)

    def run(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Every output of the pre graph on one frame (what `bundle create` records)."""
        self.check(raw)
        if self.spec.jpeg_roundtrip is not None and self.frame.kind == "image":  # the package's JPEG step first
            raw = self.spec.jpeg_roundtrip(raw, self.frame.color)
        if self.frame.kind == "sensor":  # the window as the graph declares it (samples x channels)
            frame = np.ascontiguousarray(raw, dtype=self.frame.dtype)
        else:
            frame = np.ascontiguousarray(raw if raw.ndim == 3 else raw[:, :, None])
        try:
            outs = _watched_run(self.session, self.watch, self._wanted, {PRE_GRAPH_INPUT: frame})
        except Exception as exc:  # ORT's errors for a frame the graph cannot take
            raise PreprocessError(f"stage pre ({self.path.name}) failed on a frame of shape {list(raw.shape)}: "
                                  f"{' '.join(str(exc).split())[:300]}") from exc
        result = dict(zip(self._wanted, outs))
        t = result[self.output_name]
        if t.ndim == self._rank - 1:  # a graph that gives one sample: the batch axis is added here
            result[self.output_name] = t = t[np.newaxis]
        if t.ndim != self._rank or t.shape[0] != 1:
            raise PreprocessError(f"stage pre: output {self.output_name!r} has shape {list(t.shape)}, the model takes "
                                  f"rank {self._rank} with a batch of 1")
        wrong = {i: d for i, d in self._fixed_dims.items() if t.shape[i] != d}
        if wrong:  # the model cannot take it, and frames of two sizes could not share a batch
            want = [1] + [self._fixed_dims.get(i, "any") for i in range(1, self._rank)]
            raise PreprocessError(f"stage pre ({self.path.name}): output {self.output_name!r} has shape "
                                  f"{list(t.shape)} on a frame of shape {list(raw.shape)}, the model takes {want}")
        return result

    def with_geometry(self, raw: np.ndarray) -> tuple[np.ndarray, Geometry]:
        outs = self.run(raw)
        if self.frame.kind == "sensor":
            return np.ascontiguousarray(outs[self.output_name]), IDENTITY
        t = np.ascontiguousarray(outs[self.output_name])
        return t, geometry_of(outs.get(GEOMETRY), raw.shape[0], raw.shape[1], input_size(t))

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        return self.with_geometry(raw)[0]

    def geometry(self, raw: np.ndarray) -> Geometry:
        return self.with_geometry(raw)[1]


class VocabularyPostprocessor:
    """The declarative decoders (agent.vocabulary.decoders), behind the interface a post graph has too."""

    stage_graph = False

    def __init__(self, spec: PostprocessSpec, labels: Sequence[str]):
        self.spec = spec
        self.labels = tuple(labels)

    def decode(self, outputs: Mapping[str, np.ndarray], geometry: Geometry, max_bytes: int) -> dict[str, Any]:
        return decode(self.spec, outputs, self.labels, geometry, max_bytes)


class GraphPostprocessor:
    """`postprocess.graph`: one sample's model outputs (and the frame size, the geometry) -> result tensors, checked
    and made compact by the result kind (agent.results)."""

    stage_graph = True

    def __init__(self, path: Path, spec: PostprocessSpec, labels: Sequence[str], charset: Sequence[str] | None):
        from agent.results import kind_for

        if spec.result is None:
            raise BundleError(f"{path}: key postprocess.result: a post graph needs the result kind it serves")
        self.spec = spec
        self.result: ResultSpec = spec.result
        self.kind = kind_for(self.result.kind)
        self._spec = self.result.as_mapping()
        self.labels = tuple(labels)
        self.charset = None if charset is None else tuple(charset)
        self.path = path
        self.session = stage_session(path, "post")
        self.input_names = [i.name for i in self.session.get_inputs()]
        graph_outputs = {o.name for o in self.session.get_outputs()}
        # each field's output (named in `result`, else the field's own name) that the graph has: the load
        # check refused a graph lacking a required or a named one
        wanted = [self.result.output_for(f.name) for f in self.kind.FIELDS]
        self.output_names = [n for n in dict.fromkeys(wanted) if n in graph_outputs]
        self.watch: StageWatch | None = None  # set while serving (agent.service.boot)

    def tensors(self, outputs: Mapping[str, np.ndarray], geometry: Geometry) -> dict[str, np.ndarray]:
        """The post graph's outputs on one sample, by graph output name (what `bundle create` records)."""
        feeds: dict[str, np.ndarray] = {}
        for name in self.input_names:
            if name == FRAME_SIZE:
                feeds[name] = np.array([geometry.frame_h, geometry.frame_w], dtype=np.int64)
            elif name == GEOMETRY:
                feeds[name] = geometry_values(geometry)
            elif name in outputs:
                feeds[name] = np.asarray(outputs[name])[np.newaxis]  # one sample, batch axis of 1 kept
            else:
                raise StageOutputError(f"stage post: input {name!r} is not among the model outputs {sorted(outputs)}")
        try:
            outs = _watched_run(self.session, self.watch, self.output_names, feeds)
        except Exception as exc:  # ORT's errors for tensors the graph cannot take
            raise StageOutputError(f"stage post ({self.path.name}) failed: {' '.join(str(exc).split())[:300]}") from exc
        return dict(zip(self.output_names, outs))

    def compact(self, tensors: Mapping[str, np.ndarray], max_bytes: int,
                geometry: Geometry | None = None) -> dict[str, Any]:
        """Graph outputs (by name) -> the kind's checked, compact result; with the geometry, the kind also knows
        the frame's size (`frame_size`, (h, w): a mask is served at it)."""
        spec = self._spec
        if geometry is not None and geometry.frame_h > 0 and geometry.frame_w > 0:
            spec = {**spec, FRAME_SIZE: (geometry.frame_h, geometry.frame_w)}
        if max_bytes > 0:  # a kind may refuse a result it knows is over the cap before building it
            spec = {**spec, "max_result_bytes": max_bytes}
        problems = self.kind.check(tensors, spec)
        if problems:
            raise StageOutputError(f"stage post ({self.path.name}): " + "; ".join(problems))
        try:
            result = self.kind.compact(tensors, spec, self.labels, self.charset or ())
        except BundleError as exc:  # values the kind cannot serve (a token beyond the charset): this frame only
            raise StageOutputError(f"stage post ({self.path.name}): {exc}") from exc
        check_result_size(result, max_bytes)
        return result

    def decode(self, outputs: Mapping[str, np.ndarray], geometry: Geometry, max_bytes: int) -> dict[str, Any]:
        return self.compact(self.tensors(outputs, geometry), max_bytes, geometry)


Postprocessor = VocabularyPostprocessor | GraphPostprocessor
AnyPreprocessor = Preprocessor | GraphPreprocessor


def preprocessor_for(bundle: Bundle) -> AnyPreprocessor:
    """The bundle's preprocessing: its pre graph in its own session, or the declarative vocabulary."""
    m = bundle.manifest
    if m.preprocess.graph is not None:
        return GraphPreprocessor(bundle.path(m.preprocess.graph), m.frame, m.preprocess, m.input)
    return Preprocessor(m.preprocess, m.frame)


def read_charset(path: Path) -> list[str]:
    """A charset file, read by the text kind's own rule (agent.results.text.read_charset)."""
    from agent.results.text import read_charset as parse

    return list(parse(path.read_text(encoding="utf-8")))


def postprocessor_for(bundle: Bundle) -> Postprocessor:
    """The bundle's postprocessing: its post graph in its own session with its result kind, or the decoders."""
    m = bundle.manifest
    if m.postprocess.graph is None:
        return VocabularyPostprocessor(m.postprocess, bundle.labels())
    r = m.postprocess.result
    charset = read_charset(bundle.path(r.charset)) if r is not None and r.charset is not None else None
    return GraphPostprocessor(bundle.path(m.postprocess.graph), m.postprocess, bundle.labels(), charset)
