"""What the page shows of the proof while serving, pulled out of a health document: the audit's counters
(canary and live audit), its last checks and the evidence of any drift, the re-proof schedule, and the
loud states (pinned below floor, degraded). Pure functions over plain JSON values.

The self-test report is what the boot proved; the health document (`agent.service.controller.health`:
`audit` from `agent.service.audit.Auditor.to_dict`, `reproof` from `agent.service.reproof.Reproof.to_dict`)
is what serving has seen since. The page shows both, each under its own time stamp.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

# (key in Auditor.to_dict, what it counts): the same counters /metrics exports as edge_agent_audit_*_total
AUDIT_COUNTERS = (
    ("canary_runs", "golden canaries run through the live session"),
    ("canary_failures", "canaries that did not reproduce the recorded outputs"),
    ("live_samples", "live inferences re-run through the reference"),
    ("live_windows", "live-audit windows judged by the fidelity floors"),
    ("live_drift", "live-audit windows under the fidelity floors"),
    ("errors", "audit steps that raised (serving untouched)"),
)


def _map(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def when(unix: Any) -> str:
    """A unix time as people read it (UTC, to the second); "-" when there is none."""
    t = _num(unix)
    if t is None:
        return "-"
    try:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "-"


def _strs(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def loud_states(health: Mapping[str, Any], figures: Mapping[str, Any]) -> list[str]:
    """What an operator must see beside "serving", from the report's figures and health's: the same
    states as systemd's STATUS (`agent.service.audit.loud_state`), with their evidence."""
    out = []
    sel = {**_map(figures), **{k: v for k, v in _map(health.get("selftest")).items() if v}}
    if sel.get("pinned_below_floor"):
        out.append(f"PINNED BELOW FLOOR: {sel['pinned_below_floor']}")
    if sel.get("degraded"):
        out.append(f"DEGRADED (latency): {sel['degraded']}")
    d = _map(_map(health.get("audit")).get("degraded"))
    if d:
        out.append(f"DEGRADED: the {d.get('check', '?')} audit of {d.get('candidate', '?')} drifted "
                   f"at {when(d.get('at_unix'))}")
    changed = _map(sel.get("served_changed"))
    if changed:
        out.append(f"answers changed since the last boot: {changed.get('previous')} then, {changed.get('now')} now")
    return out


def audit_view(audit: Mapping[str, Any]) -> dict[str, Any] | None:
    if not audit:
        return None
    last = _map(audit.get("last"))
    canary, live = _map(last.get("canary")), _map(last.get("live"))
    d = _map(audit.get("degraded"))
    return {
        "state": str(audit.get("state", "?")),
        "candidate": audit.get("candidate"),
        "reference": audit.get("reference"),
        "reference_error": audit.get("reference_error"),
        "canary_period_s": audit.get("canary_period_s"),
        "live_period_s": audit.get("live_period_s"),
        "counters": [(k, audit.get(k, 0), what) for k, what in AUDIT_COUNTERS],
        "canary": None if not canary else {"sample": canary.get("sample"), "passed": canary.get("passed"),
                                           "at": when(canary.get("at_unix"))},
        "live": None if not live else {"frames": live.get("frames"), "passed": live.get("passed"),
                                       "at": when(live.get("at_unix")),
                                       "metrics": sorted(_map(live.get("metrics")).items())},
        "degraded": None if not d else {"check": d.get("check"), "candidate": d.get("candidate"),
                                        "reference": d.get("reference"), "at": when(d.get("at_unix")),
                                        "where": (f"sample {d['sample']}" if d.get("sample") is not None
                                                  else f"{d['frames']} live frames" if d.get("frames") else "-"),
                                        "findings": _strs(d.get("findings"))},
    }


def reproof_view(reproof: Mapping[str, Any], health_ts: Any) -> dict[str, Any] | None:
    if not reproof:
        return None
    nxt = _num(reproof.get("next_attempt_unix"))
    left = _num(reproof.get("next_attempt_in_s"))
    last = _map(reproof.get("last"))
    return {
        "armed": bool(reproof.get("armed")),
        "attempts": reproof.get("attempts", 0),
        "healed": reproof.get("healed", 0),
        "reason": reproof.get("reason"),
        "next": "-" if nxt is None else f"{when(nxt)} ({left:g} s after this health message)" if left is not None
                else when(nxt),
        "schedule": [x for x in reproof.get("schedule_s") or [] if _num(x) is not None],
        "last": None if not last else {"attempt": last.get("attempt"), "at": when(last.get("started_unix"))},
        "as_of": when(health_ts),
    }


def serving_view(health: Mapping[str, Any] | None, figures: Mapping[str, Any]) -> dict[str, Any] | None:
    """Everything the page's "while serving" section shows; None without a health document."""
    if not isinstance(health, Mapping):
        return None
    return {
        "as_of": when(health.get("ts")),
        "device": health.get("device_id"),
        "serving": bool(health.get("serving")),
        "variant": health.get("variant"),
        "not_serving_reason": health.get("not_serving_reason"),
        "loud": loud_states(health, figures),
        "audit": audit_view(_map(health.get("audit"))),
        "reproof": reproof_view(_map(health.get("reproof")), health.get("ts")),
    }
