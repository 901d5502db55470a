"""A rollout plan: which devices, in which phases, how fast, and the bounds its gates hold (pure).

The plan is written once (a retained broker document, see agent.fleet.state) and never changes while
the rollout runs: pausing, approving or aborting are decisions recorded beside it, not edits to it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.fleet.facts import FactsRow

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class Gates:
    """Bounds a phase's proven figures must hold before the next phase starts. Defaults, or the
    operator's: never derived from what the devices measured."""

    abort_failure_pct: float = 20.0       # abort when failures / finished reaches this ...
    abort_min_finished: int = 10          # ... once at least this many devices finished
    min_committed_pct: float = 80.0       # a phase's started devices that must be committed and reachable
    min_fidelity_margin_p10: float = 0.0  # p10 over committed devices of (fidelity metric - author's floor)
    max_latency_ratio_p95: float = 1.0    # p95 over committed devices of (self-test p95 / budget)
    max_accelerator_fallbacks: int = 0    # devices that ran the old bundle on an accelerator and now on CPU


@dataclass(frozen=True)
class Artifact:
    """The bundle the rollout installs: fetched by URL (one HTTP server or object store)."""

    url: str
    sha256: str
    name: str
    version: int

    def names(self, committed: Mapping[str, Any]) -> bool:
        """Whether a device's committed bundle (its facts' `bundle.committed`) is this artifact."""
        return committed.get("name") == self.name and committed.get("version") == self.version


@dataclass(frozen=True)
class Plan:
    id: str
    artifact: Artifact
    targets: tuple[str, ...]             # every device, in start order
    phases: tuple[int, ...]              # cumulative device counts; the last is len(targets)
    rate_per_min: float = 60.0           # devices started per minute, at most
    max_downloads: int = 50              # devices downloading at once, fleet-wide
    device_timeout_s: float = 600.0      # download + self-test + probation, per device
    soak_s: float = 0.0                  # after a phase finished, before its gate is judged
    human_gate: bool = False             # wait for `fleet rollout approve` between phases
    gates: Gates = field(default_factory=Gates)
    where: tuple[tuple[str, str], ...] = ()
    previous: Mapping[str, Any] = field(default_factory=dict)  # device -> its facts' accelerator before the rollout
    published: float = 0.0               # when `rollout start` published it: with the id, what a control request names
    schema: int = PLAN_SCHEMA

    def phase_of(self, index: int) -> int:
        return next(i for i, end in enumerate(self.phases) if index < end)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["where"] = [list(w) for w in self.where]
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        return Plan(id=str(d["id"]), artifact=Artifact(**d["artifact"]), targets=tuple(d["targets"]),
                    phases=tuple(int(x) for x in d["phases"]), rate_per_min=float(d["rate_per_min"]),
                    max_downloads=int(d["max_downloads"]), device_timeout_s=float(d["device_timeout_s"]),
                    soak_s=float(d["soak_s"]), human_gate=bool(d["human_gate"]), gates=Gates(**d["gates"]),
                    where=tuple((str(k), str(v)) for k, v in d.get("where") or []),
                    previous=dict(d.get("previous") or {}), published=float(d.get("published") or 0.0),
                    schema=int(d.get("schema", PLAN_SCHEMA)))


def parse_count(spec: str | int, total: int) -> int:
    """`10` devices or `5%` of the targets (at least one when the targets are not empty)."""
    s = str(spec).strip()
    if s.endswith("%"):
        n = math.ceil(total * float(s[:-1]) / 100.0)
    else:
        n = int(s)
    if n < 0:
        raise ValueError(f"count {spec!r} is negative")
    return min(total, max(1 if total else 0, n))


def phase_ends(total: int, canary: str | int, steps: Sequence[float] | None = None, ramp: float | None = None) -> tuple[int, ...]:
    """Cumulative phase sizes: the canary, then % steps of the targets (e.g. 10, 50, 100), or an
    exponential ramp (each phase `ramp` times the previous). Always ends with every target."""
    first = parse_count(canary, total)
    ends = [first] if first else []
    if steps:
        for pct in steps:
            ends.append(math.ceil(total * float(pct) / 100.0))
    elif ramp:
        if ramp <= 1:
            raise ValueError(f"ramp {ramp} must be above 1 (each phase that many times the previous)")
        n = max(first, 1)
        while n < total:
            n = math.ceil(n * ramp)
            ends.append(min(n, total))
    ends.append(total)
    out: list[int] = []
    for e in ends:
        e = min(total, e)
        if not out or e > out[-1]:
            out.append(e)
    return tuple(out)


def start_order(rollout_id: str, devices: Sequence[str], prefer: Sequence[tuple[str, str]] = (),
                rows: Mapping[str, FactsRow] | None = None) -> list[str]:
    """A stable spread: devices sorted by a hash of (rollout, device), so each phase samples every
    group; devices matching `prefer` (the canary's filter) come first."""
    def key(d: str) -> tuple[int, str]:
        row = (rows or {}).get(d)
        first = 0 if prefer and row is not None and row.matches(list(prefer)) else 1
        return first, hashlib.sha256(f"{rollout_id}/{d}".encode()).hexdigest()
    return sorted(devices, key=key)


def select_targets(rows: Mapping[str, FactsRow], where: Sequence[tuple[str, str]], artifact: Artifact,
                   rejected: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Devices the rollout may update, and why each other one is left out. A device whose self-test
    rejected this bundle (same sha) on the provider it still runs is never offered it again."""
    chosen, skipped = [], {}
    for d, row in sorted(rows.items()):
        if not row.matches(list(where)):
            continue
        com = row.committed()
        if com.get("name") == artifact.name and isinstance(com.get("version"), int) and com["version"] >= artifact.version:
            skipped[d] = f"already at {com['name']} v{com['version']}"
            continue
        prov = ((row.facts.get("providers") or {}).get("effective") or [None])[0]
        if rejected and rejected.get(d) is not None and rejected[d] == prov:
            skipped[d] = f"its self-test rejected this bundle on {prov} in an earlier rollout"
            continue
        chosen.append(d)
    return chosen, skipped
