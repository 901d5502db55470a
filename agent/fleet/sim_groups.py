"""The simulated fleet's declared groups: each group's distribution (fates, timings, figures), the fate drawn for
every device (exact per group, seeded), and the groups read from a file or `name:count[:key=val,...]` items.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.proof.terms import CPU

FATES = ("ok", "reject", "rollback", "crash", "hang", "flaky", "offline")


@dataclass(frozen=True)
class GroupProfile:
    """One group's declared distribution. Percentages are exact per group (a seeded shuffle picks
    which devices), so a test's threshold is crossed by design, not by luck."""

    name: str
    count: int
    reject_pct: float = 0.0      # self-test rejects the bundle
    rollback_pct: float = 0.0    # probation fails (inference errors): rolled back
    crash_pct: float = 0.0       # the device drops (last will) during the self-test, back after crash_down_s
    hang_pct: float = 0.0        # the self-test never ends within the rollout's time-out
    flaky_pct: float = 0.0       # the link drops (last will) when the self-test starts, back after flaky_down_s;
    #                              the update goes on meanwhile and its verdict is reported on reconnect
    offline_pct: float = 0.0     # connects once (its facts retained), then drops for good (its last will)
    slow_pct: float = 0.0        # the self-test takes slow_factor times longer (still passes)
    selftest_s: tuple[float, float] = (0.2, 0.6)
    probation_s: float = 0.3
    slow_factor: float = 5.0
    crash_down_s: float = 2.0
    flaky_down_s: float = 20.0
    hang_s: float = 3600.0
    provider: str = CPU
    fallback_pct: float = 0.0    # the new bundle's self-test selects CPU although the old one ran on `provider`
    p95_ms: tuple[float, float] = (4.0, 8.0)
    budget_ms: float = 50.0
    fidelity_margin: tuple[float, float] = (0.01, 0.02)  # top-1 agreement above the floor
    labels: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> GroupProfile:
        known = set(GroupProfile.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"group {d.get('name')!r}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        kw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return GroupProfile(**kw)


def assign_fates(groups: list[GroupProfile], seed: int) -> list[tuple[str, GroupProfile, str, bool, bool]]:
    """(device id, group, fate, slow, fallback) for every simulated device, deterministic for a seed."""
    out = []
    rng = random.Random(seed)
    for g in groups:
        ids = [f"sim-{g.name}-{i:04d}" for i in range(g.count)]
        fates = []
        for fate, pct in (("reject", g.reject_pct), ("rollback", g.rollback_pct), ("crash", g.crash_pct),
                          ("hang", g.hang_pct), ("flaky", g.flaky_pct), ("offline", g.offline_pct)):
            fates += [fate] * round(g.count * pct / 100.0)
        fates += ["ok"] * (g.count - len(fates))
        rng.shuffle(fates)
        slow = set(rng.sample(range(g.count), round(g.count * g.slow_pct / 100.0)))
        fall = set(rng.sample(range(g.count), round(g.count * g.fallback_pct / 100.0)))
        out += [(d, g, f, i in slow, i in fall) for i, (d, f) in enumerate(zip(ids, fates[:g.count]))]
    return out


def load_groups(spec: str | Path, default_count: int | None = None) -> list[GroupProfile]:
    """Groups from a YAML/JSON file (a list of GroupProfile mappings) or `name:count[:key=val,...]` items
    separated by ';', e.g. `a:50;b:50:reject_pct=30`."""
    p = Path(str(spec))
    if p.exists():
        import yaml

        data = yaml.safe_load(p.read_text())
        items = data.get("groups") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError(f"{p}: expected a list of groups (or {{groups: [...]}}), found {type(items).__name__}")
        return [GroupProfile.from_dict(g) for g in items]
    groups = []
    for item in str(spec).split(";"):
        parts = item.strip().split(":")
        if not parts[0]:
            continue
        kw: dict[str, Any] = {"name": parts[0], "count": int(parts[1]) if len(parts) > 1 else (default_count or 1)}
        for kv in (parts[2].split(",") if len(parts) > 2 else []):
            k, _, v = kv.partition("=")
            kw[k] = float(v) if k.endswith(("_pct", "_s", "_ms", "_factor")) else v
        groups.append(GroupProfile.from_dict(kw))
    return groups


def split_devices(total: int, groups: list[GroupProfile]) -> list[GroupProfile]:
    """`--devices N` over the declared groups' shares (their counts as weights)."""
    weight = sum(g.count for g in groups) or 1
    out, left = [], total
    for i, g in enumerate(groups):
        n = left if i == len(groups) - 1 else round(total * g.count / weight)
        out.append(replace(g, count=n))
        left -= n
    return out
