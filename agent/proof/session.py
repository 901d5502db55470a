"""Build an ONNX Runtime session for one (model, provider) and measure where its nodes really run.

Placement comes from ORT's graph-assignment info where this ORT has it, else from a profiling run's
`args.provider` per node. ORT's own output during creation is captured: they carry the reason a
provider silently fell back (a library that failed to load, a missing device).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import onnxruntime as ort

from agent.proof.terms import CPU, LatencyStats, Placement, SessionSettings

ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass
class OpenedSession:
    session: ort.InferenceSession
    requested: str
    effective: tuple[str, ...]
    placement: Placement
    ort_log: list[str] = field(default_factory=list)
    create_ms: float = 0.0

    @property
    def input_name(self) -> str:
        return self.session.get_inputs()[0].name

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, tensor: np.ndarray) -> dict[str, np.ndarray]:
        outs = self.session.run(None, {self.input_name: tensor})
        return dict(zip(self.output_names, outs))


_fd_capture_allowed = True


def forbid_fd_capture() -> None:
    """For the serving process: fds 1 and 2 carry results and logs and are never redirected there.

    Native output is captured only in the self-test child (`agent.service.selftest_child`), where a
    redirect cannot swallow another thread's output."""
    global _fd_capture_allowed
    _fd_capture_allowed = False


@contextmanager
def capture_provider_output() -> Iterator[list[str]]:
    """Collect what ORT and provider libraries write to fds 1 and 2 inside the block.

    Native loggers write to fd 2, and ORT's Python layer prints its fallback notice ("EP Error ...
    Falling back") to stdout, which would corrupt `--json` output; both carry the reason a provider
    fell back, so both are kept as log lines instead.
    """
    lines: list[str] = []
    if not _fd_capture_allowed:
        yield lines
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        for fd in saved:
            os.dup2(tmp.fileno(), fd)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            lines.extend(line for line in tmp.read().decode("utf-8", "replace").splitlines() if line.strip())


def session_options(settings: SessionSettings, record_assignment: bool = True) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = _OPT_LEVELS[settings.graph_optimization]
    so.intra_op_num_threads = settings.intra_op_threads
    so.inter_op_num_threads = settings.inter_op_threads
    so.log_severity_level = 2  # warnings: the fallback messages we want to capture
    # ORT's memory pattern plans one buffer for a run's activations from the first runs' shapes; off, the
    # arena serves each tensor. Measured on YOLOv8n (CPU, 1 thread, 3 December 2026): 1024 input 220 -> 162
    # MB RSS, 320 input 98-100 -> 94 MB, CPU per inference the same within the rounds' spread.
    so.enable_mem_pattern = settings.memory_pattern
    if not settings.allow_spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if record_assignment:
        so.add_session_config_entry(ASSIGNMENT_KEY, "1")
    return so


def provider_list(provider: str, options: Mapping[str, Any] | None) -> list[Any]:
    opts = {k: str(v) for k, v in (options or {}).items()}
    if provider == CPU:
        return [(CPU, opts)] if opts else [CPU]
    # CPU stays last so nodes the accelerator cannot take still run; placement measures how many.
    return [(provider, opts), CPU]


def open_session(
    model: Path | str | bytes,
    provider: str,
    options: Mapping[str, Any] | None = None,
    settings: SessionSettings = SessionSettings(),
    sample: np.ndarray | None = None,
) -> OpenedSession:
    """Create the session, record effective providers and placement. Raises what ORT raises."""
    so = session_options(settings)
    src = model if isinstance(model, bytes) else str(model)
    t0 = time.perf_counter()
    with capture_provider_output() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = ort.InferenceSession(src, so, providers=provider_list(provider, options))
    log.extend(str(w.message) for w in caught)  # e.g. "Specified provider ... is not in available provider names"
    create_ms = (time.perf_counter() - t0) * 1000
    placement = placement_from_assignment(sess)
    if placement is None:
        placement = placement_from_profile(src, provider, options, settings, sample)
    return OpenedSession(sess, provider, tuple(sess.get_providers()), placement, log, create_ms)


def placement_from_assignment(sess: ort.InferenceSession) -> Placement | None:
    getter = getattr(sess, "get_provider_graph_assignment_info", None)
    if getter is None:
        return None
    try:
        subgraphs = getter()
    except Exception:  # older builds raise when the entry is unsupported; profiling covers them
        return None
    nodes: dict[str, int] = {}
    ops: dict[str, dict[str, int]] = {}
    partitions, last = 0, None
    for sg in subgraphs:
        ep = sg.ep_name
        if ep != last:
            partitions += 1
            last = ep
        for node in sg.get_nodes():
            nodes[ep] = nodes.get(ep, 0) + 1
            per = ops.setdefault(ep, {})
            per[node.op_type] = per.get(node.op_type, 0) + 1
    return Placement(nodes, ops, partitions, "graph_assignment")


def placement_from_profile(
    src: str | bytes,
    provider: str,
    options: Mapping[str, Any] | None,
    settings: SessionSettings,
    sample: np.ndarray | None,
) -> Placement:
    """Fallback for ORT builds without graph-assignment info: one profiled run, nodes by `args.provider`."""
    if sample is None:
        return Placement({}, {}, 0, "none")
    so = session_options(settings, record_assignment=False)
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = os.path.join(tmp, "placement")
        with capture_provider_output():
            sess = ort.InferenceSession(src, so, providers=provider_list(provider, options))
        sess.run(None, {sess.get_inputs()[0].name: sample})
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
    seen: dict[str, tuple[str, str]] = {}
    order: list[str] = []
    for ev in events:
        args = ev.get("args", {})
        if ev.get("cat") != "Node" or "provider" not in args:
            continue
        name = ev["name"].removesuffix("_kernel_time")
        if name not in seen:
            order.append(name)
        seen[name] = (args["provider"], args.get("op_name", "?"))
    nodes: dict[str, int] = {}
    ops: dict[str, dict[str, int]] = {}
    partitions, last = 0, None
    for name in order:
        ep, op = seen[name]
        if ep != last:
            partitions += 1
            last = ep
        nodes[ep] = nodes.get(ep, 0) + 1
        ops.setdefault(ep, {})[op] = ops.setdefault(ep, {}).get(op, 0) + 1
    return Placement(nodes, ops, partitions, "profiling")


def measure_latency(run: Callable[[np.ndarray], Any], tensor: np.ndarray, warmup: int, runs: int) -> "LatencyStats":
    """Warm-up calls, then `runs` timed calls of `run(tensor)`: the one latency loop everything uses."""

    for _ in range(warmup):
        run(tensor)
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        run(tensor)
        samples.append(time.perf_counter_ns() - t0)
    return LatencyStats.from_ns(samples)
