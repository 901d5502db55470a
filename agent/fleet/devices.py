"""The newest retained documents of every device as the operator holds them (facts, availability, update
status, command replies), with the rules that keep an older document from replacing a newer one."""

from __future__ import annotations

from typing import Any

from agent.fleet.facts import FactsRow


def _session(doc: Any) -> int:
    try:
        return int((doc or {}).get("session") or 0)
    except (TypeError, ValueError, AttributeError):
        return 0


class DeviceCache:
    """The newest retained documents of every device, by device id, from `edge/<id>/...` topics."""

    def __init__(self, root: str):
        self.root = root.rstrip("/") + "/"
        self.facts: dict[str, dict[str, Any]] = {}
        self.availability: dict[str, dict[str, Any]] = {}
        self.status: dict[str, dict[str, Any]] = {}
        self.replies: dict[str, dict[str, Any]] = {}

    def topics(self) -> list[str]:
        r = self.root
        return [r + "+/facts", r + "+/availability", r + "+/update/status", r + "+/cmd/update/reply",
                r + "+/cmd/rollback/reply"]

    def take(self, topic: str, doc: Any) -> str | None:
        """Store a device message; returns the device id, or None when the topic is not a device's."""
        if not topic.startswith(self.root) or not isinstance(doc, dict):
            return None
        device, _, rest = topic[len(self.root):].partition("/")
        table = {"facts": self.facts, "availability": self.availability, "update/status": self.status,
                 "cmd/update/reply": self.replies, "cmd/rollback/reply": self.replies}.get(rest)
        if table is None:
            return None
        if rest == "facts" and _older(doc, self.facts.get(device), _session(doc) - _session(self.facts.get(device))):
            return device  # an older session's facts never overwrite a newer session's, nor older ones of one session
        if rest == "update/status" and _older(doc, self.status.get(device), 0, same_update=True):
            return device
        if rest == "availability" and doc.get("state") == "offline":
            # a last will carries the number of the connection it belongs to (set before that connect as the
            # persisted counter + 1): one numbered below the live session is an older connection's, delivered
            # late, and never hides the live one (Sparkplug's bdSeq idea)
            held = self.availability.get(device) or {}
            if held.get("state") == "online" and _session(doc) < _session(held):
                return device
        table[device] = doc
        return device

    def rows(self) -> dict[str, FactsRow]:
        return {d: FactsRow(d, f, self.availability.get(d, {})) for d, f in self.facts.items()}

    def online(self, device: str) -> bool:
        return (self.availability.get(device) or {}).get("state") == "online"


def _older(doc: dict[str, Any], held: dict[str, Any] | None, session_diff: int, same_update: bool = False) -> bool:
    """`doc` is older than what is held: an earlier session, or the same session (or, for update status, the same
    update) with an earlier `ts`. A broker cluster may deliver two retained publishes of one device to one topic
    out of order (aedes on Redis did: the facts from before a commit arrived after the facts from after it, and
    the rollout waited for that device until its time-out); the device's own clock orders them."""
    if held is None or session_diff > 0:
        return False
    if session_diff < 0:
        return True
    if same_update and doc.get("update") != held.get("update"):
        return False
    try:
        return float(doc.get("ts") or 0) < float(held.get("ts") or 0)
    except (TypeError, ValueError):
        return False
