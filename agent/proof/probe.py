"""Which execution providers really work here: listed by ORT is a claim, a session that runs is proof.

Each provider is probed with a tiny shipped model: create a session asking for it, check that the
session kept it (`get_providers()`), that the probe's nodes were placed on it, and that it runs.
"""

from __future__ import annotations

import platform
import re
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from agent.proof.isa import cpu_isa, isa_line
from agent.proof.session import open_session
from agent.proof.terms import (
    CPU,
    CUDA,
    DEFAULT_ORDER,
    OPENVINO,
    TENSORRT,
    ProviderStatus,
    SessionSettings,
    reason_from_log,
)


def probe_model_bytes() -> bytes:
    return resources.files("agent").joinpath("data/probe.onnx").read_bytes()


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def provider_versions(name: str) -> dict[str, str]:
    """Versions worth knowing when this provider misbehaves; only what can be read without side effects."""
    out = {"onnxruntime": ort.__version__}
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino"):
        v = _dist_version(dist)
        if v:
            out[f"dist:{dist}"] = v
    if name in (CUDA, TENSORRT):
        driver = Path("/proc/driver/nvidia/version")
        if driver.exists():
            first = driver.read_text().splitlines()[0]
            m = re.search(r"Kernel Module\s+([0-9.]+)", first)
            out["nvidia_driver"] = m.group(1) if m else first.strip()
        for dist in ("nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "tensorrt"):
            v = _dist_version(dist)
            if v:
                out[f"dist:{dist}"] = v
    if name == OPENVINO:
        v = _dist_version("openvino")
        if v:
            out["openvino"] = v
    return out


def probe_provider(
    name: str,
    options: Mapping[str, Any] | None = None,
    settings: SessionSettings = SessionSettings(),
) -> ProviderStatus:
    """Probe one provider for real; never raises for a provider failure, it becomes the reason."""
    listed = name in ort.get_available_providers()
    opts = {k: str(v) for k, v in (options or {}).items()}
    versions = provider_versions(name)
    if not listed:
        hint = {
            CUDA: "install onnxruntime-gpu",
            TENSORRT: "install onnxruntime-gpu with TensorRT libraries",
            OPENVINO: "install onnxruntime-openvino",
        }.get(name, "this onnxruntime build does not include it")
        return ProviderStatus(name, False, False, f"not listed by this onnxruntime build ({hint})", opts, versions=versions)
    sample = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    try:
        opened = open_session(probe_model_bytes(), name, opts, settings, sample=sample)
    except Exception as exc:  # provider libraries raise all sorts; each is a reason, not a crash
        return ProviderStatus(name, True, False, f"session creation failed: {_one_line(exc)}", opts, versions=versions)
    effective = opened.effective
    placement = opened.placement
    on = placement.nodes_by_provider.get(name, 0)
    base: dict[str, Any] = dict(options=opts, effective=effective, nodes_on_provider=on,
                                total_nodes=placement.total_nodes, versions=versions)
    if name not in effective:
        why = reason_from_log(opened.ort_log) or "ORT dropped it without a logged reason"
        return ProviderStatus(name, True, False, f"silent fallback: session runs on {list(effective)}: {why}", **base)
    if name != CPU and placement.source != "none" and on == 0:
        return ProviderStatus(
            name, True, False,
            f"silent fallback: {name} is registered but 0 of {placement.total_nodes} probe nodes run on it",
            **base,
        )
    try:
        out = opened.run(sample)
    except Exception as exc:
        return ProviderStatus(name, True, False, f"probe run failed: {_one_line(exc)}", **base)
    y = next(iter(out.values()))
    if not np.all(np.isfinite(y)):
        return ProviderStatus(name, True, False, "probe run produced non-finite outputs", **base)
    return ProviderStatus(name, True, True, None, **base)


def detect_providers(
    order: Sequence[str] = DEFAULT_ORDER,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    settings: SessionSettings = SessionSettings(),
) -> list[ProviderStatus]:
    options = options or {}
    return [probe_provider(name, options.get(name), settings) for name in order]


def device_fingerprint() -> dict[str, str]:
    """What identifies this device's compute for cache keys: CPU model and flags, machine, GPU driver."""
    info = {"machine": platform.machine(), "system": platform.system(), "python": platform.python_version(),
            "isa": isa_line()}
    if cpu_isa()["from"] == "cpuinfo":  # on arm64 under qemu-user, /proc/cpuinfo names the x86 host: not this device
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
            for key in ("model name", "flags"):
                m = re.search(rf"^{key}\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
                if m:
                    info[key.replace(" ", "_")] = m.group(1).strip()
        except OSError:
            pass
    driver = Path("/proc/driver/nvidia/version")
    if driver.exists():
        info["nvidia"] = driver.read_text().splitlines()[0].strip()
    return info


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}"
