"""What a device's messages mean for the rollout, and whether a phase may advance (pure).

A device succeeds only once its update says `committed` AND its retained facts, published after the
commit over the same connection, show the new bundle committed while it is online: reachable after the
switch. Failures: rejected (by its self-test, or earlier), rolled back, timed out, went offline (and stayed
away past the device time-out), refused. A device whose link drops mid-update stays in flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.fleet.plan import Plan
from agent.updates.machine import State
from agent.updates.status import state_of

FINAL_STATES = ("committed", "rejected", "rolled_back")
SELFTEST_REJECTION = "self-test failed"  # the updater's reason prefix (agent/updates/flow.py, proving)


@dataclass(frozen=True)
class Outcome:
    state: str               # "committed" | "failed"
    kind: str                # committed | rejected_selftest | rejected | rolled_back | timed_out | went_offline | refused
    reason: str
    provider: str | None = None  # the provider it ran when its self-test rejected the bundle


def _effective(facts: Mapping[str, Any] | None) -> str | None:
    return (((facts or {}).get("providers") or {}).get("effective") or [None])[0]


def observe(plan: Plan, started_ts: float, now: float, status: Mapping[str, Any] | None,
            facts: Mapping[str, Any] | None, availability: Mapping[str, Any] | None,
            reply: Mapping[str, Any] | None) -> Outcome | None:
    """The outcome of one started device from the newest documents seen, or None while it is in flight."""
    mine = status is not None and status.get("update") == plan.id
    state = status.get("state") if mine and status else None
    if state == "committed":
        com = ((facts or {}).get("bundle") or {}).get("committed") or {}
        a = plan.artifact
        online = (availability or {}).get("state") == "online"
        fresh = float((facts or {}).get("ts") or 0) >= float(status.get("ts") or 0) - 1.0  # type: ignore[union-attr]
        if a.names(com) and online and fresh:
            return Outcome("committed", "committed", f"committed {a.name} v{a.version} and reachable")
    elif state == "rejected":
        reason = str(status.get("reason"))  # type: ignore[union-attr]
        if reason.startswith(SELFTEST_REJECTION):
            return Outcome("failed", "rejected_selftest", reason, _effective(facts))
        return Outcome("failed", "rejected", reason)
    elif state == "rolled_back":
        return Outcome("failed", "rolled_back", str(status.get("reason")))  # type: ignore[union-attr]
    # "busy" while its status names this rollout in flight: the answer to a command sent again on resume
    # (the first one arrived), not a refusal
    ours_in_flight = mine and state not in FINAL_STATES and bool(state)
    if reply is not None and not reply.get("ok") and "update" not in reply and not (ours_in_flight and reply.get("busy")):
        return Outcome("failed", "refused", str(reply.get("error")))
    # A device that dropped its link during the update is still in flight (`offline_in_progress`): a Wi-Fi
    # blip or missed keepalives on a busy host end the connection, not the update, and the device reports
    # its real verdict when it is back. Only the plan's device time-out turns it into a failure; named
    # `went_offline` when it is still away then (a last will's own ts is when the will was set, not when
    # it fired: it cannot date the loss).
    if now - started_ts > plan.device_timeout_s:
        # the finer word where the device says one (`downloading` within `receiving`); before 7 December 2026
        # that word was its state
        step = (status or {}).get("step") if mine else None
        last = (step if isinstance(step, str) else state) or "none"
        if away(availability):
            return Outcome("failed", "went_offline", f"went {(availability or {}).get('state')} during the update "
                                                     f"and no verdict within {plan.device_timeout_s:g} s "
                                                     f"(last step: {last})")
        return Outcome("failed", "timed_out", f"no verdict within {plan.device_timeout_s:g} s (last step: {last})")
    return None


def away(availability: Mapping[str, Any] | None) -> bool:
    """The device's link is down (its last will, or it said it stopped)."""
    return (availability or {}).get("state") in ("offline", "stopped")


def downloading(plan: Plan, status: Mapping[str, Any] | None) -> bool:
    """Started and not yet past its download: what the fleet-wide download cap counts."""
    if status is None or status.get("update") != plan.id:
        return True
    # the machine's `receiving`; a device from before 7 December 2026 says downloading, progress or missing
    return state_of(status) == State.RECEIVING.value


def abort_reason(finished: int, failed: int, plan: Plan) -> str | None:
    g = plan.gates
    if finished >= g.abort_min_finished and finished and 100.0 * failed / finished >= g.abort_failure_pct:
        return (f"{failed} of {finished} finished devices failed ({100.0 * failed / finished:.1f} % >= "
                f"abort_failure_pct {g.abort_failure_pct:g} %, after abort_min_finished {g.abort_min_finished})")
    return None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    v = sorted(values)
    if not v:
        return None
    return v[max(0, min(len(v) - 1, math.ceil(q / 100.0 * len(v)) - 1))]


@dataclass(frozen=True)
class Check:
    name: str
    measured: Any
    bound: Any
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class GateResult:
    phase: int
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def summary(self) -> str:
        return "; ".join(f"{c.name} {'ok' if c.passed else 'FAILED'}: {c.measured} vs {c.bound}"
                         + (f" ({c.detail})" if c.detail else "") for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "passed": self.passed,
                "checks": [{"name": c.name, "measured": c.measured, "bound": c.bound, "passed": c.passed,
                            **({"detail": c.detail} if c.detail else {})} for c in self.checks]}


def judge_phase(plan: Plan, phase: int, records: Mapping[str, Mapping[str, Any]],
                facts: Mapping[str, Mapping[str, Any]], online: Mapping[str, bool]) -> GateResult:
    """The gate after `phase`, over every device of phases 0..phase: committed share, fidelity margin
    p10, latency ratio p95, accelerator fallbacks, and every committed device still reachable."""
    g = plan.gates
    devices = plan.targets[:plan.phases[phase]]
    recs = [records.get(d) or {} for d in devices]
    committed = [d for d, r in zip(devices, recs) if r.get("state") == "committed"]
    pct = round(100.0 * len(committed) / len(devices), 2) if devices else 0.0
    checks = [Check("committed_pct", pct, g.min_committed_pct, pct >= g.min_committed_pct,
                    f"{len(committed)} of {len(devices)} committed and reachable")]
    proofs = [((facts.get(d) or {}).get("proof") or {}) for d in committed]
    margins = [p["fidelity"]["margin"] for p in proofs if (p.get("fidelity") or {}).get("margin") is not None]
    ratios = [p["latency_ratio"] for p in proofs if p.get("latency_ratio") is not None]
    p10 = percentile(margins, 10)
    checks.append(Check("fidelity_margin_p10", p10, g.min_fidelity_margin_p10,
                        p10 is not None and p10 >= g.min_fidelity_margin_p10,
                        f"{len(margins)} of {len(committed)} committed devices reported a fidelity margin"))
    p95 = percentile(ratios, 95)
    checks.append(Check("latency_ratio_p95", p95, g.max_latency_ratio_p95,
                        p95 is not None and p95 <= g.max_latency_ratio_p95,
                        f"{len(ratios)} of {len(committed)} committed devices reported p95 and a budget"))
    fell = [d for d in committed if plan.previous.get(d) and not (facts.get(d) or {}).get("accelerator")]
    checks.append(Check("accelerator_fallbacks", len(fell), g.max_accelerator_fallbacks,
                        len(fell) <= g.max_accelerator_fallbacks, ", ".join(fell[:5])))
    gone = [d for d in committed if not online.get(d)]
    checks.append(Check("committed_reachable", len(committed) - len(gone), len(committed), not gone,
                        ("offline: " + ", ".join(gone[:5])) if gone else ""))
    return GateResult(phase, tuple(checks))
