"""Device facts: what a rollout targets on and gates with, built from plain values (pure).

Both sides use this module: a device (the controller, the simulator) builds its retained `facts`
document with `device_facts`; the operator reads rows from it with `FactsRow` and filters them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.link.health import (
    candidate_figures,  # pure: the figures health and /metrics show
)

FACTS_SCHEMA = 1
ACCELERATORS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "OpenVINOExecutionProvider",
                "CoreMLExecutionProvider", "DmlExecutionProvider", "ROCMExecutionProvider", "QNNExecutionProvider")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def parse_bundle_id(bid: str | None) -> dict[str, Any] | None:
    """A store id `<name>-v<version>-<sha12>` as {name, version, sha}; None for None or another shape."""
    if not bid:
        return None
    head, _, sha = bid.rpartition("-")
    name, _, version = head.rpartition("-v")
    if not name or not version.isdigit():
        return {"name": bid, "version": None, "sha": None}
    return {"name": name, "version": int(version), "sha": sha}


def prior_version(facts: Mapping[str, Any], runs_rollout: bool) -> dict[str, Any] | None:
    """{name, version} a device had before a rollout, from its own facts: its previous committed bundle
    when it committed the rollout's, else its committed one (it has not switched yet). None when its
    facts do not say (an agent from before `bundle.previous`)."""
    b = facts.get("bundle") or {}
    got = b.get("previous") if runs_rollout else b.get("committed")
    return {"name": got.get("name"), "version": got.get("version")} if isinstance(got, Mapping) else None


def fidelity_margin(fidelity: Mapping[str, Any] | None) -> float | None:
    """The smallest distance of a fidelity metric from its floor (the author's bound, not a measurement):
    `min_X` bounds give metric - bound, `max_X` bounds give bound - metric. Negative: under the floor."""
    if not isinstance(fidelity, Mapping):
        return None
    m, b = fidelity.get("metrics"), fidelity.get("bounds")
    metrics: Mapping[str, Any] = m if isinstance(m, Mapping) else {}
    bounds: Mapping[str, Any] = b if isinstance(b, Mapping) else {}
    margins = []
    for key, bound in bounds.items():
        floor = _num(bound)
        for prefix, sign in (("min_", 1.0), ("max_", -1.0)):
            if floor is not None and str(key).startswith(prefix):
                metric = _num(metrics.get(str(key)[len(prefix):]))
                if metric is not None:
                    margins.append(sign * (metric - floor))
    return round(min(margins), 6) if margins else None


def reproduction_margin(reproduction: Mapping[str, Any] | None) -> float | None:
    """Headroom of the worst element under its reproduction bound: 1 - abs_diff / bound (1: exact, <0: over)."""
    tol = reproduction.get("tolerance") if isinstance(reproduction, Mapping) else None
    if not isinstance(tol, Mapping):
        return None
    diff, bound = _num(tol.get("abs_diff")), _num(tol.get("bound"))
    if diff is None or not bound:
        return None
    return round(1.0 - diff / bound, 6)


def candidate_proof(report: Mapping[str, Any] | None, budget_ms: float | None = None) -> dict[str, Any] | None:
    """The self-test figures of the selected candidate: reproduction margin, fidelity metric, floor and
    margin, p95 vs budget, the fraction of nodes on its provider."""
    if not isinstance(report, Mapping):
        return None
    sel = report.get("selected") if isinstance(report.get("selected"), Mapping) else None
    cands = [c for c in report.get("candidates") or [] if isinstance(c, Mapping)]
    if sel is None:
        return {"passed": bool(report.get("passed")), "reason": report.get("reason")}
    c = next((c for c in cands if c.get("provider") == sel.get("provider") and c.get("variant") == sel.get("variant")), {})
    fig = candidate_figures(c) if c else {}
    fid = c.get("fidelity") if isinstance(c.get("fidelity"), Mapping) else {}
    # a passing candidate's report may not carry its budget: then the bundle author's, from the manifest
    p95, budget = fig.get("p95_ms"), fig.get("budget_ms") if fig.get("budget_ms") is not None else budget_ms
    return {
        "passed": bool(report.get("passed")),
        "provider": sel.get("provider"), "variant": sel.get("variant"),
        "reproduction_margin": reproduction_margin(c.get("reproduction") if isinstance(c.get("reproduction"), Mapping) else None),
        "fidelity": {"metrics": dict(fid.get("metrics") or {}), "floors": dict(fid.get("bounds") or {}),
                     "margin": fidelity_margin(fid)} if fid else None,
        "p95_ms": p95, "budget_ms": budget,
        "latency_ratio": round(p95 / budget, 4) if p95 is not None and budget else None,
        "provider_fraction": fig.get("provider_fraction"),
    }


def device_facts(*, device_id: str, session: int, labels: Mapping[str, str], versions: Mapping[str, str],
                 report: Mapping[str, Any] | None, effective: list[str] | None, current: str | None,
                 committed: str | None, active: Mapping[str, Any] | None, last_failure: Mapping[str, Any] | None,
                 budget_ms: float | None = None, ts: float | None = None,
                 device: Mapping[str, Any] | None = None, previous: str | None = None) -> dict[str, Any]:
    """The retained facts document. `current`/`committed` are store ids; without a store, `active`
    ({name, version, sha}) stands for both. `previous`: the store's committed bundle before the committed
    one (what a rollback returns to), so an operator that lost its records (a broker killed before it saved
    them) still knows each device's real previous version. `last_failure` is the last rejected or
    rolled-back update status."""
    usable = [str(p.get("name")) for p in (report or {}).get("providers") or [] if isinstance(p, Mapping) and p.get("usable")]
    eff = list(effective or [])
    cur = parse_bundle_id(current) or (dict(active) if active else None)
    com = parse_bundle_id(committed) or (dict(active) if active else None)
    return {
        "schema": FACTS_SCHEMA,
        "ts": round(time.time() if ts is None else ts, 3),
        "device_id": device_id,
        "session": session,
        "labels": {str(k): str(v) for k, v in labels.items()},
        "versions": {k: versions[k] for k in ("agent", "onnxruntime") if k in versions},
        "providers": {"usable": usable, "effective": eff},
        "accelerator": next((p for p in eff if p in ACCELERATORS), None),
        "bundle": {"current": cur, "committed": com, "previous": parse_bundle_id(previous)},
        "last_failure": None if not last_failure else {
            k: last_failure.get(k) for k in ("update", "state", "reason", "ts") if k in last_failure},
        "proof": candidate_proof(report, budget_ms),
        "device": dict(device) if device else None,  # {machine, features, from}: what the proof ran on
    }


@dataclass(frozen=True)
class FactsRow:
    """One device as the fleet table and the planner see it: facts plus availability."""

    device: str
    facts: Mapping[str, Any]
    availability: Mapping[str, Any]

    @property
    def online(self) -> bool:
        """The availability the operator kept says online (DeviceCache drops a late will of an older session)."""
        return self.availability.get("state") == "online"

    def committed(self) -> Mapping[str, Any]:
        return ((self.facts.get("bundle") or {}).get("committed")) or {}

    def value(self, key: str) -> list[str]:
        """Every value a `--where key=value` filter can match: labels by name, and a few fact keys."""
        f = self.facts
        prov = f.get("providers") or {}
        com = self.committed()
        known: dict[str, list[Any]] = {
            "device": [self.device],
            "provider": list(prov.get("usable") or []) + list(prov.get("effective") or []),
            "effective": list(prov.get("effective") or [])[:1],
            "accelerator": [f.get("accelerator")],
            "agent": [(f.get("versions") or {}).get("agent")],
            "onnxruntime": [(f.get("versions") or {}).get("onnxruntime")],
            "bundle": [com.get("name")],
            "version": [com.get("version")],
            "availability": [self.availability.get("state", "unknown")],
        }
        if key in known:
            return [str(v) for v in known[key] if v is not None]
        v = (f.get("labels") or {}).get(key)
        return [] if v is None else [str(v)]

    def matches(self, where: list[tuple[str, str]]) -> bool:
        return all(val in self.value(key) for key, val in where)

    def row(self) -> dict[str, Any]:
        f = self.facts
        com, cur = self.committed(), ((f.get("bundle") or {}).get("current")) or {}
        proof = f.get("proof") or {}
        fid = proof.get("fidelity") or {}
        return {
            "device": self.device, "availability": self.availability.get("state", "unknown"),
            "labels": ",".join(f"{k}={v}" for k, v in sorted((f.get("labels") or {}).items())),
            "agent": (f.get("versions") or {}).get("agent"),
            "provider": ((f.get("providers") or {}).get("effective") or [None])[0],
            "committed": f"{com.get('name')}@{com.get('version')}" if com else None,
            "current": f"{cur.get('name')}@{cur.get('version')}" if cur else None,
            "fidelity_margin": fid.get("margin"), "p95_ms": proof.get("p95_ms"), "budget_ms": proof.get("budget_ms"),
            "last_failure": (f.get("last_failure") or {}).get("reason"),
        }


def parse_where(items: list[str]) -> list[tuple[str, str]]:
    """`key=value` filters; an item without '=' is an error that names it."""
    out = []
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--where {item!r}: expected KEY=VALUE, e.g. provider=OpenVINOExecutionProvider or site=north")
        out.append((key.strip(), val.strip()))
    return out
