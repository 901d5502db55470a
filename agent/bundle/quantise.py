"""The variants' builds: INT8 by static quantisation over streamed calibration feeds (with the exclusions
a spec names or the stages imply), FP16 by conversion, and what a prequantised model already holds."""

from __future__ import annotations

import difflib
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from agent.errors import BundleError, install_hint
from agent.logsetup import get_logger
from agent.vocabulary.inputs import InputFeeder

if TYPE_CHECKING:
    from agent.bundle.build_spec import CreateOptions

log = get_logger("bundle.create")
INSTALL_BUILD_HINT = install_hint("build", "onnx sympy")


def need_build_extra() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise BundleError(f"`bundle create` needs the build tools (onnx, sympy): {INSTALL_BUILD_HINT}") from exc
    return onnx


def reason_of(exc: BaseException) -> str:
    """An exception as a reason a person can read: never an empty string."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} with no message ({exc!r})"


class CalibrationFeeds:
    """Streams calibration feeds: frames are preprocessed when ORT asks for them, in batches where the
    input has a dynamic batch, and a stateful model's sequences run through FP32 so each step carries
    the state it would have in serving. Nothing holds the whole calibration set as tensors.

    Logs `bundle.create.calibrating` with samples done, elapsed and ETA every few seconds.
    """

    def __init__(self, samples: Sequence[np.ndarray], prepare: Any, feeder: InputFeeder, batch: int = 1,
                 fp32: Any = None, progress_every_s: float = 2.0):
        self.samples, self.prepare, self.feeder, self.batch = samples, prepare, feeder, max(1, batch)
        self.fp32 = fp32  # a session for the state of stateful models
        self.progress_every_s = progress_every_s
        self.rewind()

    def rewind(self) -> None:
        self._it = self._generate()
        self.done = 0
        self._t0 = time.perf_counter()
        self._last_log = self._t0

    def _generate(self) -> Any:
        if self.feeder.stateful:
            names = [o.name for o in self.fp32.get_outputs()]
            for seq in self.samples:
                self.feeder.reset("calibration")
                for frame in seq:
                    feeds = self.feeder.feeds(self.prepare(frame), "calibration")
                    yield feeds, 0
                    self.feeder.advance("calibration", dict(zip(names, self.fp32.run(None, feeds))))
                self._count(1)
            return
        for i in range(0, len(self.samples), self.batch):
            chunk = self.samples[i : i + self.batch]
            tensor = np.concatenate([self.prepare(r) for r in chunk]) if len(chunk) > 1 else self.prepare(chunk[0])
            yield self.feeder.feeds(tensor, "calibration"), len(chunk)

    def _count(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last_log >= self.progress_every_s or self.done == len(self.samples):
            self._last_log = now
            elapsed = now - self._t0
            eta = elapsed / self.done * (len(self.samples) - self.done) if self.done else None
            log.info("bundle.create.calibrating", done=self.done, total=len(self.samples), elapsed_s=round(elapsed, 1),
                     eta_s=None if eta is None else round(eta, 1))

    def get_next(self) -> dict[str, np.ndarray] | None:
        item = next(self._it, None)
        if item is None:
            return None
        feeds, n = item
        if n:
            self._count(n)
        return feeds


def resolve_exclusions(graph: Any, source: Any, opts: CreateOptions) -> list[str]:
    """Node names to keep in float, from names, patterns, op types and --exclude-after subgraphs.

    Every name, pattern and op type must match something in the source model (`source`, what the user
    sees in Netron); unknown ones are errors naming them. Nodes are then taken from `graph` (the model
    after ORT's quantisation pre-processing) by name."""
    src_nodes = [n.name for n in source.node]
    all_nodes = {n.name for n in graph.node} | set(src_nodes)

    def unknown_node(flag: str, name: str) -> BundleError:
        close = difflib.get_close_matches(name, src_nodes, n=3)
        hint = f"; did you mean {close}?" if close else ""
        return BundleError(f"{flag} {name!r}: no node of that name in {opts.model}{hint}")

    exclude: list[str] = []
    for name in opts.exclude_nodes:
        if name not in all_nodes:
            raise unknown_node("--exclude-node", name)
        exclude.append(name)
    for pattern in opts.exclude_node_patterns:
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise BundleError(f"--exclude-node-pattern {pattern!r}: not a regular expression: {exc}") from exc
        hits = [n.name for n in graph.node if rx.search(n.name)]
        if not hits:
            raise BundleError(f"--exclude-node-pattern {pattern!r}: matches no node in {opts.model}")
        exclude += hits
    if opts.exclude_op_types:
        present = {n.op_type for n in graph.node} | {n.op_type for n in source.node}
        for op in opts.exclude_op_types:
            if op not in present:
                raise BundleError(f"--exclude-op-type {op!r}: the model has no such node (op types: {sorted(present)})")
        exclude += [n.name for n in graph.node if n.op_type in opts.exclude_op_types]
    for name in opts.exclude_after:
        if name not in all_nodes:
            raise unknown_node("--exclude-after", name)
        g = graph if name in {n.name for n in graph.node} else source
        exclude += downstream(g, name)
    return list(dict.fromkeys(exclude))


def downstream(graph: Any, start: str) -> list[str]:
    """`start` and every node that consumes, directly or not, one of its outputs."""
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    by_name = {n.name: n for n in graph.node}
    seen = [start]
    frontier = list(by_name[start].output)
    names = {start}
    while frontier:
        t = frontier.pop()
        for n in consumers.get(t, ()):
            if n.name not in names:
                names.add(n.name)
                seen.append(n.name)
                frontier.extend(n.output)
    return seen


def quantize_int8(fp32: Path, out: Path, calib: CalibrationFeeds, opts: CreateOptions) -> dict[str, Any]:
    onnx = need_build_extra()
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        t0 = time.perf_counter()
        shape_inference = "symbolic"
        try:
            quant_pre_process(str(fp32), str(pre), auto_merge=True)
        except Exception as exc:
            # ORT's symbolic shape inference asserts on some control flow (Silero VAD's If branches on the
            # sample rate); ONNX's own shape inference handles them, so try it before giving up.
            log.warning("bundle.create.symbolic_shape_inference_failed", reason=reason_of(exc), fallback="onnx")
            try:
                quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
                shape_inference = "onnx"
            except Exception as exc2:
                raise BundleError(f"{fp32}: ORT quantization pre-processing failed: {reason_of(exc)}; "
                                  f"without symbolic shape inference: {reason_of(exc2)}") from exc2
        exclude = resolve_exclusions(onnx.load(str(pre)).graph, onnx.load(str(fp32)).graph, opts)
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[opts.method]
        # No CalibMaxIntermediateOutputs: ORT's MinMax collect_data *discards* the collected runs each time
        # that count is reached (it clears without merging), so a set of exactly 16 batch-1 runs ended in
        # "No data is collected." and 20 runs were calibrated on the last 4. MinMax keeps only each tensor's
        # ReduceMin/ReduceMax per run (the model's own outputs are dropped), so memory stays small anyway.
        extra: dict[str, Any] = {}
        # uint8 activations with int8 weights: the S8S8 default is not fused on x86 and runs slower than FP32.
        try:
            quantize_static(
                str(pre), str(out), calib,
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                per_channel=opts.per_channel,
                reduce_range=opts.reduce_range,
                calibrate_method=method,
                nodes_to_exclude=exclude,
                extra_options=extra,
            )
        except BundleError:
            raise
        except Exception as exc:
            raise BundleError(f"{fp32}: INT8 quantization failed: {reason_of(exc)}") from exc
        quantized = count_quantized_nodes(onnx.load(str(out)).graph)
        if quantized == 0:
            # Silero VAD: its Conv and LSTM nodes sit inside If branches, which ORT's quantizer does not
            # enter; a float model named int8 would pass every check and tell the device nothing.
            raise BundleError(f"{fp32}: INT8 quantization quantized no node (no QuantizeLinear/DequantizeLinear in "
                              "the result; ORT's quantizer does not enter If/Loop subgraphs): build without it (--no-int8)")
    return {"format": "QDQ", "activations": "uint8", "weights": "int8", "weight_bits": 7 if opts.reduce_range else 8,
            "per_channel": opts.per_channel,
            "method": opts.method, "calibration_samples": calib.done, "excluded_nodes": exclude,
            "shape_inference": shape_inference, "quantized_nodes": quantized,
            "seconds": round(time.perf_counter() - t0, 1)}


QUANTIZED_OPS = frozenset({"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeLSTM",
                           "DynamicQuantizeMatMul", "QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul",
                           "QGemm", "MatMulIntegerToFloat", "QAttention"})


def _op_counts(graph: Any, out: dict[str, int]) -> dict[str, int]:
    for node in graph.node:
        out[node.op_type] = out.get(node.op_type, 0) + 1
        for a in node.attribute:
            if a.g is not None and a.g.node:
                _op_counts(a.g, out)
            for g in a.graphs:
                _op_counts(g, out)
    return out


def prequantized(model_path: Path) -> dict[str, Any] | None:
    """What makes a model already quantised -- QuantizeLinear/DequantizeLinear pairs, integer ops
    (ConvInteger, MatMulInteger, QLinear*), dynamic quantisation (DynamicQuantize*), quantisation metadata
    -- or None for a float model. Quantising such a graph again breaks it (duplicate node names) or
    quantises nothing; it is kept as the int8 variant."""
    onnx = need_build_extra()
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception:
        return None  # prepare_fp32 reports an unreadable model with its own message
    ops = _op_counts(model.graph, {})
    found = {k: v for k, v in sorted(ops.items()) if k in QUANTIZED_OPS}
    for op in ("QuantizeLinear", "DequantizeLinear"):  # QDQ pairs, or weights-only DequantizeLinear
        if ops.get(op):
            found[op] = ops[op]
    meta = sorted(p.key for p in model.metadata_props if "quant" in p.key.lower())
    if not found and not meta:
        return None
    return {"ops": found, **({"metadata": meta} if meta else {})}


def count_quantized_nodes(graph: Any) -> int:
    """QuantizeLinear/DequantizeLinear nodes in a graph and its subgraphs."""
    n = 0
    for node in graph.node:
        n += node.op_type in ("QuantizeLinear", "DequantizeLinear")
        for a in node.attribute:
            if a.g is not None and a.g.node:
                n += count_quantized_nodes(a.g)
            for g in a.graphs:
                n += count_quantized_nodes(g)
    return n


def convert_fp16(fp32: Path, out: Path) -> dict[str, Any]:
    onnx = need_build_extra()
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True)
    onnx.save(model, str(out))
    return {"keep_io_types": True}
