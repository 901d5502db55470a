"""The health payload: what a fleet operator needs to see at a glance, built from plain values (pure)
plus a process probe (RSS, CPU) that reads /proc."""

from __future__ import annotations

import os
import platform
import resource
import time
from typing import Any, Mapping

import numpy as np
import onnxruntime as ort

from agent import __version__

HEALTH_SCHEMA = 1


class ProcessProbe:
    """Current RSS and CPU use since the previous call."""

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._wall = time.monotonic()

    def sample(self) -> dict[str, float]:
        cpu, wall = time.process_time(), time.monotonic()
        pct = 100.0 * (cpu - self._cpu) / max(wall - self._wall, 1e-6)
        self._cpu, self._wall = cpu, wall
        try:
            rss_pages = int(open("/proc/self/statm").read().split()[1])
            rss_mb = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rss_mb": round(rss_mb, 1), "cpu_percent": round(pct, 1)}


def versions() -> dict[str, str]:
    return {"agent": __version__, "onnxruntime": ort.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def build_health(
    *,
    device_id: str,
    uptime_s: float,
    session: int,
    interval_s: float,
    serving: bool,
    not_serving_reason: str | None,
    engine: Mapping[str, Any] | None,
    placement: Mapping[str, int] | None,
    selftest: Mapping[str, Any] | None,
    pipeline: Mapping[str, Any] | None,
    source: Mapping[str, Any] | None,
    outbox: Mapping[str, Any] | None,
    process: Mapping[str, float],
    paused: bool = False,
) -> dict[str, Any]:
    return {
        "schema": HEALTH_SCHEMA,
        "ts": round(time.time(), 3),
        "device_id": device_id,
        "session": session,
        "uptime_s": round(uptime_s, 1),
        "interval_s": interval_s,
        "serving": serving,
        "paused": paused,
        "not_serving_reason": not_serving_reason,
        "bundle": None if engine is None else {k: engine[k] for k in ("bundle", "version", "label")},
        "variant": None if engine is None else engine["variant"],
        "provider": None if engine is None else {
            "requested": engine["provider"], "effective": list(engine["effective_providers"])},
        "nodes_by_provider": dict(placement or {}),
        "selftest": dict(selftest or {}),
        "pipeline": dict(pipeline or {}),
        "source": dict(source or {}),
        "outbox": dict(outbox or {}),
        "process": dict(process),
        "versions": versions(),
    }
