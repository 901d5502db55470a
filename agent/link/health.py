"""The health payload: what a fleet operator needs to see at a glance, built from plain values (pure)
plus a process probe (RSS, CPU) that reads /proc.

`selftest_figures` is the one place the self-test's headline figures are computed from a report: the
health payload, `/metrics` and the report page all read them from here, so they cannot disagree.
"""

from __future__ import annotations

import math
import os
import platform
import re
import resource
import time
from datetime import datetime
from typing import Any, Mapping

from agent import __version__
from agent.proof.isa import cpu_isa
from agent.proof.overall import proof_verdict

HEALTH_SCHEMA = 1

_BUDGET = re.compile(r"latency p\d+ = [\d.eE+-]+ ms over budget ([\d.eE+-]+) ms")


class ProcessProbe:
    """Current RSS and CPU use since the previous call."""

    MIN_WINDOW_S = 1.0  # calls closer together (a /metrics scrape beside the health timer) reuse the last figure

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._wall = time.monotonic()
        self._pct = 0.0

    def sample(self) -> dict[str, float]:
        cpu, wall = time.process_time(), time.monotonic()
        if wall - self._wall >= self.MIN_WINDOW_S:
            self._pct = 100.0 * (cpu - self._cpu) / (wall - self._wall)
            self._cpu, self._wall = cpu, wall
        pct = self._pct
        try:
            rss_pages = int(open("/proc/self/statm").read().split()[1])
            rss_mb = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rss_mb": round(rss_mb, 1), "cpu_percent": round(pct, 1),
                "cpu_seconds": round(cpu, 3)}


def versions() -> dict[str, str]:
    import numpy as np
    import onnxruntime as ort  # only here: the figures below stay importable without ORT

    return {"agent": __version__, "onnxruntime": ort.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def _list(v: Any) -> list[Any]:
    """A list from a report, or an empty one when the key is missing or malformed."""
    return v if isinstance(v, list) else []


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    n = _num(v)
    return int(n) if n is not None and math.isfinite(n) else None


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def report_candidates(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The report's candidate entries, skipping anything that is not one (a report of another version)."""
    cands = doc.get("candidates")
    return [c for c in cands if isinstance(c, Mapping)] if isinstance(cands, list) else []


def _budget_ms(c: Mapping[str, Any]) -> float | None:
    """The latency budget the candidate was judged against: recorded beside the latency, or named in
    its failure reason; None when the report carries neither (a passing candidate of an older report)."""
    lat = _map(c.get("latency"))
    for key in ("budget_ms", "latency_budget_ms"):
        if _num(lat.get(key)) is not None:
            return _num(lat.get(key))
    bounds = _map(lat.get("bounds"))
    if bounds:
        for v in bounds.values():
            b = v.get("bound") if isinstance(v, Mapping) else v
            if _num(b) is not None:
                return _num(b)
    for r in _list(c.get("reasons")):
        m = _BUDGET.search(str(r))
        if m:
            return float(m.group(1))
    return None


def candidate_figures(c: Mapping[str, Any]) -> dict[str, Any]:
    """One candidate's headline figures from its entry in the self-test report."""
    lat = _map(c.get("latency"))
    place = _map(c.get("placement"))
    nodes = {str(k): n for k, v in _map(place.get("nodes_by_provider")).items() if (n := _int(v)) is not None}
    total = sum(nodes.values())
    provider = str(c.get("provider", ""))
    status = str(c.get("status", "tested"))
    passed = bool(c.get("passed"))
    verdict = "pass" if passed else {"not_tried": "not tried", "skipped": "skipped"}.get(status, "fail")
    return {
        "key": f"{provider}:{c.get('variant', '')}",
        "provider": provider,
        "variant": c.get("variant"),
        "precision": c.get("precision"),
        "status": status,
        "passed": passed,
        "verdict": verdict,
        "reasons": [str(r) for r in _list(c.get("reasons"))],
        "p50_ms": _num(lat.get("p50_ms")),
        "p95_ms": _num(lat.get("p95_ms")),
        "p99_ms": _num(lat.get("p99_ms")),
        "latency_runs": _int(lat.get("runs")),
        "budget_ms": _budget_ms(c),
        "nodes_total": total,
        "nodes_on_provider": nodes.get(provider, 0),
        "provider_fraction": round(nodes.get(provider, 0) / total, 4) if total else None,
        "partitions": _int(place.get("partitions")),
    }


def audited(selftest: Mapping[str, Any], audit: Mapping[str, Any] | None) -> dict[str, Any]:
    """The health's self-test figures with the serving audit's word: answers that drifted while serving make a
    passed proof `degraded` (the proof held at boot, the live session no longer does)."""
    out = dict(selftest)
    if out.get("verdict") == "pass" and audit and audit.get("state") == "degraded":
        out.update(verdict="degraded", passed=False)
    return out


def selftest_figures(doc: Mapping[str, Any] | None) -> dict[str, Any]:
    """The self-test figures health, /metrics and the report page show, from one report (or from the
    few keys an older caller passes: passed, created, cached, reason)."""
    if not doc:
        return {}
    created = doc.get("created")
    created_ts = None
    if isinstance(created, str):
        try:
            created_ts = round(datetime.fromisoformat(created).timestamp(), 3)
        except ValueError:
            created_ts = None
    sel = _map(doc.get("selected")) or None
    verdict = proof_verdict(doc)
    bundle = _map(doc.get("bundle"))
    return {
        # "pass" only when a candidate passed clean: one serving degraded is never shown as passed (issue 45)
        "passed": verdict == "pass",
        "verdict": verdict,
        "reason": doc.get("reason"),
        "created": created,
        "created_ts": created_ts,
        "cached": bool(doc.get("cached")),
        "bundle": {"name": bundle.get("name"), "version": bundle.get("version")} if bundle else None,
        "selected": None if not sel else {k: sel.get(k) for k in ("provider", "variant", "precision")},
        "candidates": [candidate_figures(c) for c in report_candidates(doc)],
        # loud states an operator must see: serving below the author's floor (pinned), or a too-slow device
        "degraded": doc.get("degraded"),
        "too_slow": doc.get("too_slow"),
        "pinned_below_floor": doc.get("pinned_below_floor"),
        "served_changed": _map(doc.get("served_changed")) or None,  # another candidate than at the last boot
        "warnings": [str(w) for w in _list(doc.get("warnings"))][:10],
        # steps that killed a self-test child (a bad driver), as "step: signal"
        "crashes": [f"{c.get('step')}: {c.get('signal')}" if isinstance(c, Mapping) else str(c)
                    for c in _list(doc.get("crashes"))],
        # deaths seen with no evidence against a step (a kill from outside, the OOM killer): not charged
        "unexplained_deaths": [str(d) for d in _list(doc.get("unexplained_deaths"))][:10],
    }


def health_selftest(doc: Mapping[str, Any] | None) -> dict[str, Any]:
    """The compact form of `selftest_figures` that travels in every health message."""
    fig = selftest_figures(doc)
    if not fig:
        return {}
    keep = ("key", "verdict", "p50_ms", "p95_ms", "budget_ms", "provider_fraction")
    return {**fig, "candidates": [{k: c[k] for k in keep} for c in fig["candidates"]]}


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
    mqtt_connected: bool | None = None,
    update: Mapping[str, Any] | None = None,
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
        "selftest": health_selftest(selftest),
        "pipeline": dict(pipeline or {}),
        "source": dict(source or {}),
        "outbox": dict(outbox or {}),
        "mqtt": None if mqtt_connected is None else {"connected": mqtt_connected},
        "update": None if not update else {k: update[k] for k in ("update", "state", "ts", "reason") if k in update},
        "process": dict(process),
        "versions": versions(),
        "device": cpu_isa(),  # the architecture and ISA features the proof ran on: from this device, not the build
    }
