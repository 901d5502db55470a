"""A rollout's record keeping: its retained documents read from the broker (plan, state, control, each device's
record, the devices' own documents), each decision logged, printed and kept in the state, the state and records
written back (and republished after a broker restart), a finished rollout compacted, and its status as text.
"""

from __future__ import annotations

import json
import queue
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from agent.errors import RolloutError
from agent.fleet.devices import DeviceCache
from agent.fleet.plan import Plan
from agent.fleet.state import (
    MAX_DECISIONS,
    STATE_SCHEMA,
    FleetClient,
    RolloutTopics,
    decode,
)
from agent.logsetup import get_logger

log = get_logger("fleet")

HEARTBEAT_S = 2.0  # the state is republished at least this often while an operator runs


class RolloutRecords:
    """One rollout's retained documents as an operator holds them: read from the broker (plan, state, control,
    device records, the devices' own documents), and the decisions, state and records written back."""

    def __init__(self, client: FleetClient, rollout_id: str, device_root: str, out: TextIO | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float = 0.1):
        self.client, self.t = client, RolloutTopics(rollout_id)
        self.devices = DeviceCache(device_root)
        self.out = out or sys.stderr
        self.clock, self.tick_s = clock, tick_s
        self.owner = f"{socket.gethostname()}:{id(self):x}"
        self.plan: Plan | None = None
        self.state: dict[str, Any] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.control: dict[str, Any] | None = None
        self.index: dict[str, int] = {}
        self._beat = 0.0
        self._dirty = False
        self._running = False
        self.taken_over: str | None = None
        self._connects = 0  # the client's connections this operator has reconciled after
        self._rejections: dict[str, Any] | None = None  # the index last published (None: not yet)

    # -- loading ---------------------------------------------------------------------------------------
    def topics(self) -> list[str]:
        return self.devices.topics() + [self.t.all]

    def ingest(self, topic: str, payload: bytes) -> None:
        doc = decode(payload)
        if topic.startswith(self.t.base):
            rest = topic[len(self.t.base):]
            if rest == "plan" and doc:
                self.plan = Plan.from_dict(doc)
                self.index = {d: i for i, d in enumerate(self.plan.targets)}
            elif rest == "state" and doc and int(doc.get("rev", 0)) >= int(self.state.get("rev", 0)):
                if doc.get("owner") != self.owner:
                    if self._running:  # another operator took over (resume --force): this one steps aside
                        self.taken_over = str(doc.get("owner"))
                        return
                    self.state = doc
            elif rest == "control" and doc:
                self.control = doc
            elif rest.startswith("device/") and doc:
                d = rest[len("device/"):]
                if int(doc.get("rev", 0)) >= int((self.records.get(d) or {}).get("rev", 0)):
                    self.records[d] = doc
            return
        self.devices.take(topic, doc)

    def load(self) -> None:
        for topic, payload, _ in self.client.sync():
            self.ingest(topic, payload)
        if self.plan is None:
            raise RolloutError(f"no rollout {self.t.id!r} on the broker ({self.t.plan} is empty): "
                               "start it with `edge-agent fleet rollout start PLAN.json`")

    def drain(self) -> None:
        while True:
            try:
                topic, payload, _ = self.client.inbox.get_nowait()
            except queue.Empty:
                return
            self.ingest(topic, payload)

    # -- writing -----------------------------------------------------------------------------------------
    def decide(self, event: str, **detail: Any) -> None:
        """A decision: logged, printed, and kept (timestamped) in the state document."""
        rec = {"ts": round(self.clock(), 3), "event": event, **detail}
        self.state.setdefault("decisions", []).append(rec)
        self.state["decisions"] = self.state["decisions"][-MAX_DECISIONS:]
        log.info("fleet." + event, rollout=self.t.id, **detail)
        print(f"{time.strftime('%H:%M:%S', time.gmtime(rec['ts']))} {event} "
              + " ".join(f"{k}={v}" for k, v in detail.items()), file=self.out, flush=True)
        self._dirty = True

    def save_state(self, release: bool = False) -> None:
        """`release`: this operator stops here; another may take over at once (no lease to wait out)."""
        self.state.update(schema=STATE_SCHEMA, id=self.t.id, rev=int(self.state.get("rev", 0)) + 1, owner=self.owner,
                          heartbeat=round(self.clock(), 3), counts=self.counts(), released=release)
        self.client.publish(self.t.state, self.state)
        self._beat, self._dirty = self.clock(), False
        rejected = {d: r.get("provider") for d, r in sorted(self.records.items()) if r.get("kind") == "rejected_selftest"}
        if rejected != self._rejections:
            self.client.publish(self.t.rejections, {"rejected_selftest": rejected})
            self._rejections = rejected

    def save_record(self, device: str, **changes: Any) -> dict[str, Any]:
        rec = {**(self.records.get(device) or {"device": device}), **changes}
        rec["rev"] = int(rec.get("rev", 0)) + 1
        self.client.publish(self.t.device(device), rec)  # acknowledged before anything is sent to the device
        self.records[device] = rec
        return rec

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {"targets": len(self.plan.targets) if self.plan else 0, "started": 0, "committed": 0,
                             "failed": 0, "in_flight": 0, "offline_in_progress": 0, "rolled_back_by_fleet": 0}
        for r in self.records.values():
            c["started"] += 1
            if r.get("state") == "started" and r.get("offline_since"):
                c["offline_in_progress"] += 1
            c[r.get("state", "started") if r.get("state") in ("committed", "failed") else "in_flight"] += 1
            if (r.get("rollback") or {}).get("state") == "done":
                c["rolled_back_by_fleet"] += 1
        return c

    def reconcile_after_reconnect(self) -> None:
        """After a reconnect, the broker may have restarted and lost what it had not yet saved (Mosquitto
        persists at its autosave interval): this operator's state and records are republished, so the
        retained truth is again the newest (their revs never go back), and a later resume or rollback
        reads it. The devices' own retained documents come again with the resubscription."""
        n = self.client.connects
        if n <= max(1, self._connects):
            self._connects = max(self._connects, n)
            return
        self._connects = n
        for d, rec in sorted(self.records.items()):
            self.client.publish(self.t.device(d), rec, wait=False)
        self.decide("broker_reconnected", republished_records=len(self.records), connects=n)


def compact(op: RolloutRecords) -> int:
    """Remove a finished rollout's device records (empty retained publishes), keeping its plan, its state
    (counts, decisions, and now `compacted`) and its rejections index: what a later `plan` reads. A later
    `fleet rollback` still finds the devices by their facts (their previous versions are then unknown).
    Returns the number of records removed."""
    st = op.state.get("status")
    if st not in ("done", "rolled_back", "rollback_aborted") and not (st == "aborted" and not op.counts()["in_flight"]):
        raise RolloutError(f"rollout {op.t.id} is {st}: only a finished rollout (done, rolled back, or aborted with "
                           "nothing in flight) is compacted")
    counts = op.counts()
    op.save_state()  # the counts and the rejections index, from the records, before they go
    removed = sorted(op.records)
    for d in removed:
        op.client.publish(op.t.device(d), b"", wait=False)
    op.state["compacted"] = {"records": len(removed), "counts": counts, "ts": round(op.clock(), 3)}
    op.decide("compacted", records=len(removed))
    op.save_state(release=True)
    return len(removed)


def status_table(state: dict[str, Any], records: dict[str, dict[str, Any]]) -> str:
    c = state.get("counts") or {}
    lines = [f"rollout {state.get('id')}: {state.get('status')} phase {state.get('phase')} rev {state.get('rev')} "
             f"owner {state.get('owner')}",
             "  " + "  ".join(f"{k}={v}" for k, v in c.items())]
    kinds: dict[str, int] = {}
    for r in records.values():
        if r.get("state") == "failed":
            kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
    if kinds:
        lines.append("  failures: " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    if state.get("gate"):
        g = state["gate"]
        lines.append(f"  gate after phase {g['phase']}: {'passed' if g['passed'] else 'FAILED'}")
        for ch in g["checks"]:
            lines.append(f"    {ch['name']:24} {ch['measured']!s:>10} vs {ch['bound']}  {'ok' if ch['passed'] else 'FAILED'}")
    for d in (state.get("decisions") or [])[-8:]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.gmtime(d['ts']))} {d['event']} "
                     + json.dumps({k: v for k, v in d.items() if k not in ('ts', 'event')})[:200])
    return "\n".join(lines)
