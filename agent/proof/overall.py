"""One word for a self-test report, the same in every channel: health, `monitor`, /metrics, the report page's
banner and an update's statuses (what `push` prints). Pure: a report's JSON in, a word out."""

from __future__ import annotations

from typing import Any, Mapping

VERDICTS = ("pass", "degraded", "fail")


def proof_verdict(doc: Mapping[str, Any]) -> str:
    """fail when nothing was selected; degraded when what serves did not pass clean (too slow for its budget under
    selection.when_too_slow: degraded, or a pinned variant below its floor); else pass. Never "pass" for what
    serves degraded."""
    if not doc.get("passed"):
        return "fail"
    return "degraded" if doc.get("degraded") or doc.get("pinned_below_floor") else "pass"
