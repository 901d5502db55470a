"""What a person must be told when nothing serves, beside the reason: the figure against its bound, the key to
change, and when the agent tries again. One place, so the boot, a reload and a re-proof say it alike."""

from __future__ import annotations

from typing import Any, Mapping


def measured(report: Mapping[str, Any] | None) -> list[str]:
    """Each tried candidate's p95 against its budget ("CPU:int8 p95 63.20 ms > budget 50 ms")."""
    out = []
    for c in (report or {}).get("candidates") or []:
        lat = c.get("latency") or {}
        p95, budget = lat.get("p95_ms"), lat.get("budget_ms")
        if isinstance(p95, (int, float)) and isinstance(budget, (int, float)):
            key = f"{str(c.get('provider', '')).replace('ExecutionProvider', '')}:{c.get('variant')}"
            out.append(f"{key} p95 {p95:.2f} ms {'>' if p95 > budget else '<='} budget {budget:g} ms")
    return out


def not_serving_advice(reason: str | None, report: Mapping[str, Any] | None, reproof: Mapping[str, Any],
                       can_receive: bool) -> dict[str, Any]:
    """`fix`: what to change (a config key, a bundle); `next_attempt`: when the agent proves again by itself."""
    doc = report or {}
    too_slow = bool(doc) and not doc.get("passed") and bool(doc.get("too_slow"))
    if too_slow:
        fix = ("selection.when_too_slow: degraded in the config serves the fastest proven candidate, marked "
               "DEGRADED; or a bundle with a larger selftest.latency_budget_ms; or a quieter machine")
    elif (reason or "").startswith("key bundle:"):
        fix = "set bundle: to a bundle directory" + (", or push one" if can_receive else "")
    elif doc and not doc.get("passed"):
        fix = ("a bundle that reproduces on this device (`edge-agent selftest --bundle DIR` shows each candidate's "
               "evidence), or selection.provider / selection.variant to pin one that passes")
    else:
        fix = "see the reason"
    if reproof.get("armed") and reproof.get("next_attempt_in_s") is not None:
        nxt = f"in {reproof['next_attempt_in_s']:g} s (re-proof schedule, selection.reproof_backoff_s)"
    elif too_slow and not reproof.get("schedule_s"):
        nxt = "none by itself: selection.reproof_backoff_s is 0; reload (SIGHUP) or restart"
    else:
        nxt = "none by itself: reload (SIGHUP), restart" + (", or push a bundle" if can_receive else "")
    return {"fix": fix, "next_attempt": nxt, "measured": measured(report)}
