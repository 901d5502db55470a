"""The pure vocabulary of proving: provider names, session settings, placement, probe status.

Values only: the self-test's judge and selection read them without importing onnxruntime.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal, Mapping, Sequence

from agent.keydoc import Key
from agent.quantiles import percentiles

CPU = "CPUExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
DEFAULT_ORDER: tuple[str, ...] = (TENSORRT, CUDA, OPENVINO, CPU)

GraphOptimization = Literal["disable", "basic", "extended", "all"]


@dataclass(frozen=True)
class SessionSettings:
    """Thread settings are the same for the self-test and serving, so the latency that was proven is
    the latency served. Defaults suit a small CPU device: one intra-op thread per inference worker
    and no spinning (spinning pool threads starve capture and preprocessing; measured in
    scripts/bench_serving.py). 0 threads means ORT's own default."""

    graph_optimization: Annotated[GraphOptimization, Key("ORT graph optimisation level")] = "all"
    intra_op_threads: Annotated[int, Key("per inference worker; 0: ORT's default (all cores)", ge=0)] = 1
    inter_op_threads: Annotated[int, Key("0: ORT's default", ge=0)] = 0
    allow_spinning: Annotated[bool, Key("ORT's default spins, which starves capture and preprocessing")] = False
    memory_pattern: Annotated[bool, Key("ORT's pre-planned activation buffer (its default: on); off keeps less "
                                        "memory at the same CPU (docs/serving.md)")] = False


@dataclass(frozen=True)
class Placement:
    """Nodes per provider after partitioning, and how often execution crosses between providers."""

    nodes_by_provider: Mapping[str, int]
    op_types_by_provider: Mapping[str, Mapping[str, int]]
    partitions: int
    source: Literal["graph_assignment", "profiling", "none"]

    @property
    def total_nodes(self) -> int:
        return sum(self.nodes_by_provider.values())

    @property
    def boundaries(self) -> int:
        return max(self.partitions - 1, 0)

    def fraction(self, provider: str) -> float:
        total = self.total_nodes
        return self.nodes_by_provider.get(provider, 0) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes_by_provider": dict(self.nodes_by_provider),
            "op_types_by_provider": {k: dict(v) for k, v in self.op_types_by_provider.items()},
            "partitions": self.partitions,
            "boundaries": self.boundaries,
            "source": self.source,
        }


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REASON_PATTERNS = (
    re.compile(r"(Failed to load library[^\n]*)"),
    re.compile(r"\[OpenVINO\]\s*([^\n]*)"),
    re.compile(r"(Failed to create [A-Za-z]+ExecutionProvider[^\n]*)"),
    re.compile(r"(EP Error[^\n]*)"),
    re.compile(r"(Require cuDNN[^\n]*)"),
    re.compile(r"(CUDA failure[^\n]*)"),
    re.compile(r"(no CUDA-capable device[^\n]*)"),
    re.compile(r"(cannot open shared object file[^\n]*)"),
    re.compile(r"(Specified provider '[A-Za-z]+' is not in available provider names)"),
    re.compile(r"\[E:onnxruntime[^\]]*\]\s*([^\n]*)"),
)


@dataclass(frozen=True)
class ProviderStatus:
    name: str
    listed: bool
    usable: bool
    reason: str | None
    options: Mapping[str, str] = field(default_factory=dict)
    effective: tuple[str, ...] = ()
    nodes_on_provider: int = 0
    total_nodes: int = 0
    versions: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["effective"] = list(self.effective)
        return d


def reason_from_log(lines: Sequence[str]) -> str | None:
    text = _ANSI.sub("", "\n".join(lines))
    for pattern in _REASON_PATTERNS:
        m = pattern.search(text)
        if m:
            return m.group(1).strip()
    return None


@dataclass(frozen=True)
class LatencyStats:
    runs: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    samples_ms: tuple[float, ...] = ()  # every timed run, in order: the report page plots their distribution

    @classmethod
    def from_ns(cls, samples_ns: Sequence[int]) -> "LatencyStats":
        # plain floats (the same doubles numpy made): importing numpy here put 0.4 s before `run` could read a config
        ms = [float(x) / 1e6 for x in samples_ns]
        p50, p95, p99 = percentiles(ms, (50, 95, 99))
        return cls(len(ms), round(p50, 4), round(p95, 4), round(p99, 4), round(math.fsum(ms) / len(ms) if ms else float("nan"), 4),
                   tuple(round(x, 4) for x in ms))


def with_compile_caches(options: Mapping[str, Mapping[str, Any]], cache_dir: str) -> dict[str, dict[str, Any]]:
    """Provider options with compile caches under `cache_dir`: TensorRT engines and OpenVINO compiled
    blobs built while the self-test child proved a candidate are reused when the serving process opens
    it (and on the next boot), instead of compiling again. Options the user set win."""
    out = {name: dict(opts) for name, opts in options.items()}
    trt = out.setdefault(TENSORRT, {})
    trt.setdefault("trt_engine_cache_enable", "True")
    trt.setdefault("trt_engine_cache_path", f"{cache_dir}/tensorrt")
    out.setdefault(OPENVINO, {}).setdefault("cache_dir", f"{cache_dir}/openvino")
    return out
