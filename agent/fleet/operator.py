"""The operator's loop: starts devices phase by phase under the rate and download caps, watches what
they report, records every outcome and decision in the rollout's retained documents, and gates each
phase on what the devices proved. `resume` is the same loop started from the documents on the broker.

The loop owns all of its state on one thread; paho's thread only puts messages on a queue.

Its record keeping (documents read and written, decisions, compaction, the status table): rollout_records.py;
`fleet rollback`: rollback.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from agent.errors import RolloutError
from agent.fleet.facts import FactsRow, prior_version
from agent.fleet.gates import abort_reason, away, downloading, judge_phase, observe
from agent.fleet.rollout_records import HEARTBEAT_S, RolloutRecords
from agent.fleet.state import FleetClient
from agent.logsetup import get_logger

log = get_logger("fleet")

TERMINAL = ("done", "aborted", "rolled_back")
LEASE_S = 10.0  # a state whose heartbeat is older than this has no live operator: resume may take it


class Operator(RolloutRecords):
    """Runs one rollout (or its fleet rollback) from its retained documents."""

    def __init__(self, client: FleetClient, rollout_id: str, device_root: str, out: TextIO | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float = 0.1):
        super().__init__(client, rollout_id, device_root, out, clock, tick_s)
        self._starts: list[float] = []  # start times in the last minute: the rate cap
        self._tokens = 1.0
        self._tokens_at = clock()
        self._soak_until: float | None = None
        self._handled_control = 0.0  # the newest control request applied (its ts), kept in the state
        self._recommand_pending = False  # set by take_over: a resume looks for uncommanded devices once
        self._awaiting_slot: set[str] = set()  # found uncommanded on resume, waiting for the caps
        self._offline_at_turn: dict[str, float] = {}  # devices offline when their turn came, since when

    # -- taking over ---------------------------------------------------------------------------------------
    def take_over(self, force: bool = False) -> None:
        st = self.state
        if st.get("status") in TERMINAL and not force:
            return
        age = self.clock() - float(st.get("heartbeat") or 0)
        if st.get("owner") and st.get("owner") != self.owner and age < LEASE_S and not st.get("released") and not force:
            raise RolloutError(f"rollout {self.t.id} is being run by {st['owner']} (heartbeat {age:.1f} s ago); "
                               f"wait {LEASE_S:g} s after it stopped, or pass --force")
        if st.get("owner"):
            self.decide("resumed", previous_owner=st.get("owner"), heartbeat_age_s=round(age, 1),
                        started=self.counts()["started"])
        # re-commanding waits for the loop: after the controls a human sent meanwhile (an abort), only while
        # running, and never for `fleet rollback` (which takes over too, but runs no step)
        self._recommand_pending = st.get("status") not in TERMINAL
        self._seed_rate(self.clock())

    def _seed_rate(self, now: float) -> None:
        """The rate cap spans operators: the starts its records show in the last minute count, and the
        token bucket is as drained as the newest of them left it. A fresh bucket on every resume let an
        operator restarted in a loop start a full minute's devices each time."""
        plan = self.plan
        if plan is None:
            return
        # starts whose command went out; one "in the future" (the previous operator's clock ahead of ours: a
        # `resume --force` from another host, an NTP step) counts as now, never as outside the minute
        recent = sorted(min(float(r["started"]), now) for r in self.records.values()
                        if r.get("commanded") and isinstance(r.get("started"), (int, float))
                        and now - float(r["started"]) < 60.0)
        self._starts = [float(t) for t in recent]
        if recent:
            rate = plan.rate_per_min / 60.0
            self._tokens, self._tokens_at = min(max(1.0, rate), (now - float(recent[-1])) * rate), now

    def _recommand_unacknowledged(self) -> None:
        """A device's `started` record is written before its command (so no command goes out unrecorded);
        an operator killed between the two leaves a device recorded as started that no command reached.
        Such a device has no `commanded` in its record and shows no sign of this rollout (no status naming
        it, no reply, the bundle not committed): it is commanded again, its device time-out counted afresh.
        Killed after the broker took the command but before `commanded` was recorded, the device may get
        it twice: the second is answered "busy" while its status names this rollout, and `observe` keeps
        it in flight."""
        plan = self.plan
        assert plan is not None
        now = self.clock()
        lost = []
        for d, rec in sorted(self.records.items()):
            if rec.get("state") != "started" or rec.get("rollback") or rec.get("commanded"):
                continue
            status = self.devices.status.get(d) or {}
            reply = self.devices.replies.get(d) or {}
            com = FactsRow(d, self.devices.facts.get(d) or {}, {}).committed()
            if (status.get("update") == plan.id or reply.get("command") == "update"
                    or plan.artifact.names(com)):
                continue
            if self.devices.online(d):  # offline: in flight until its time-out; a command would wait for nobody
                lost.append((d, rec))
        in_download = self._refill(now) - len(lost)  # the download cap counts them before any command reached them
        again, waiting = [], False
        for d, rec in lost:
            if not self._slot(now, in_download):  # a command sent again is a start: the caps hold for it too
                waiting = True
                break
            in_download += 1
            self.save_record(d, started=round(now, 3), commanded_again=round(now, 3),
                             first_started=rec.get("first_started", rec.get("started")))
            self._command(d)
            again.append(d)
        self._recommand_pending = waiting  # the rest on a later tick, once the caps allow
        # no command reached these yet: their time-out counts from the command they are waiting for, not
        # from the dead operator's `started` (they timed out while waiting for a slot)
        self._awaiting_slot = {d for d, _ in lost[len(again):]}
        if again:
            self.decide("recommanded", devices=again, reason="recorded as started, but no sign the command arrived")

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None, max_s: float | None = None) -> dict[str, Any]:
        """Run the rollout until it is terminal with nothing in flight (or `until`, or `max_s`)."""
        assert self.plan is not None
        if not self.state.get("status"):
            self.state.update(status="running", phase=0, started=round(self.clock(), 3))
            self.decide("started", targets=len(self.plan.targets), phases=list(self.plan.phases))
        self._handled_control = float(self.state.get("control_ts") or 0)
        end = None if max_s is None else time.monotonic() + max_s
        self._running = True
        while True:
            self.drain()
            if self.taken_over is not None:
                log.warning("fleet.taken_over", rollout=self.t.id, by=self.taken_over)
                print(f"rollout {self.t.id} was taken over by {self.taken_over}; this operator stops", file=self.out)
                return self.state
            self.step()
            if self._dirty or self.clock() - self._beat >= HEARTBEAT_S:
                self.save_state()
            if self.finished() or (until is not None and until()) or (end is not None and time.monotonic() > end):
                self.save_state(release=True)
                return self.state
            time.sleep(self.tick_s)

    def finished(self) -> bool:
        st = self.state.get("status")
        in_flight = self.counts()["in_flight"]
        if st in ("done", "rolled_back"):
            return True
        return st == "aborted" and in_flight == 0

    def step(self) -> None:
        plan, now = self.plan, self.clock()
        assert plan is not None
        self.reconcile_after_reconnect()
        self._apply_control()
        if self._recommand_pending and self.state.get("status") == "running":
            self._recommand_pending = False
            self._recommand_unacknowledged()
        self._observe(now)
        if self.state.get("status") == "running":
            self._advance(now)
        if self.state.get("status") == "running":
            self._start_devices(now)

    def _apply_control(self) -> None:
        c = self.control
        if not c or float(c.get("ts") or 0) <= self._handled_control:
            return
        self._handled_control = float(c["ts"])
        self.state["control_ts"] = self._handled_control
        action, st = c.get("action"), self.state.get("status")
        stale = self._stale_control(c)
        if stale is not None:
            self.decide("control_ignored", action=action, by=c.get("by"), reason=stale)
            return
        if action == "pause" and st == "running":
            self.state["status"] = "paused"
            self.decide("paused", by=c.get("by"), reason="operator request")
        elif action == "resume" and st == "paused":
            self.state["status"] = "running"
            self.decide("unpaused", by=c.get("by"))
        elif action == "abort" and st not in TERMINAL:
            self.state["status"] = "aborted"
            self.decide("aborted", by=c.get("by"), reason="operator request")
        elif action == "approve" and st in ("awaiting_approval", "held"):
            self._next_phase(f"approved by {c.get('by')}" + (" over a failed gate" if st == "held" else ""))
        elif action == "set_url" and st not in TERMINAL and isinstance(c.get("url"), str):
            # the same archive (its sha256 still checked by every device) at a fresh address: a signed URL
            # expires, and a paused or held rollout outlives it; the plan itself never changes
            self.state["url"] = c["url"]
            self.decide("url_set", by=c.get("by"), url=c["url"][:200])
        else:
            self.decide("control_ignored", action=action, status=st)

    def _stale_control(self, c: dict[str, Any]) -> str | None:
        """Why a control request is not this rollout's, or None when it is: it must name this rollout's id and
        the time its plan was published (a retained abort from an earlier rollout under the same id, or one
        sent before the id existed, must not stop this one)."""
        plan = self.plan
        assert plan is not None
        if c.get("rollout") != self.t.id or not isinstance(c.get("published"), (int, float)):
            return "not bound to a rollout (no rollout id and plan time): an old or hand-made request"
        if float(c["published"]) != plan.published:
            return (f"bound to rollout {self.t.id} published at {c['published']}, not this one (published at "
                    f"{plan.published})")
        return None

    def _observe(self, now: float) -> None:
        plan = self.plan
        assert plan is not None
        dv = self.devices
        for d, rec in list(self.records.items()):
            if rec.get("state") != "started":
                continue
            if d in self._awaiting_slot and self.state.get("status") == "running":
                continue  # not commanded yet (stopped otherwise: judged as it stands, its time-out from `started`)
            reply = dv.replies.get(d) if (dv.replies.get(d) or {}).get("command") == "update" else None
            if reply is not None and reply.get("busy") and rec.get("commanded_again"):
                # commanded twice, its "busy" may answer the second while the first runs (published before
                # the first's status): the verdict or the time-out decides
                reply = None
            o = observe(plan, float(rec["started"]), now, dv.status.get(d), dv.facts.get(d), dv.availability.get(d),
                        reply)
            if o is None:
                self._note_link(d, rec, now)
                continue
            self.save_record(d, state=o.state, kind=o.kind, reason=o.reason[:300], finished=round(now, 3),
                             **({"provider": o.provider} if o.provider else {}))
            (log.info if o.state == "committed" else log.warning)("fleet.device_" + o.kind, rollout=plan.id,
                                                                  device=d, reason=o.reason[:200])
            self._dirty = True
            if self.state.get("status") == "running":
                self._check_abort()  # after each outcome: the decision carries the counts that crossed the line

    def _note_link(self, d: str, rec: dict[str, Any], now: float) -> None:
        """An in-flight device whose link dropped is `offline_in_progress` (its record says since when);
        back online, the mark goes. Neither is a verdict: the device's own report or the time-out is."""
        gone = away(self.devices.availability.get(d))
        if gone and not rec.get("offline_since"):
            self.save_record(d, offline_since=round(now, 3))
            log.warning("fleet.device_offline_in_progress", rollout=self.t.id, device=d)
            self._dirty = True
        elif not gone and rec.get("offline_since"):
            self.save_record(d, offline_since=None, reconnected=round(now, 3))
            log.info("fleet.device_reconnected", rollout=self.t.id, device=d)
            self._dirty = True

    def _check_abort(self) -> None:
        c = self.counts()
        reason = abort_reason(c["committed"] + c["failed"], c["failed"], self.plan)  # type: ignore[arg-type]
        if reason is not None:
            self.state["status"] = "aborted"
            kinds: dict[str, int] = {}
            for r in self.records.values():
                if r.get("state") == "failed":
                    kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
            self.decide("aborted", reason=reason, failures=kinds, phase=self.state.get("phase"),
                        finished=c["committed"] + c["failed"], failed=c["failed"])

    def _advance(self, now: float) -> None:
        plan = self.plan
        assert plan is not None
        phase = int(self.state.get("phase", 0))
        end = plan.phases[phase]
        if any((self.records.get(d) or {}).get("state") in (None, "started") for d in plan.targets[:end]):
            return
        if self._soak_until is None:
            self._soak_until = now + plan.soak_s
            if plan.soak_s:
                self.decide("soaking", phase=phase, seconds=plan.soak_s)
        if now < self._soak_until:
            return
        online = {d: self.devices.online(d) for d in plan.targets[:end]}
        gate = judge_phase(plan, phase, self.records, self.devices.facts, online)
        self.state["gate"] = gate.to_dict()
        if not gate.passed:
            self.state["status"] = "held"
            self.decide("held", phase=phase, reason="gate failed: " + gate.summary())
            return
        if phase == len(plan.phases) - 1:
            self.state["status"] = "done"
            self.decide("done", phase=phase, gate=gate.summary())
        elif plan.human_gate:
            self.state["status"] = "awaiting_approval"
            self.decide("awaiting_approval", phase=phase, gate=gate.summary())
        else:
            self._next_phase("gate passed: " + gate.summary())

    def _next_phase(self, why: str) -> None:
        phase = int(self.state.get("phase", 0)) + 1
        self.state.update(phase=phase, status="running")
        self._soak_until = None
        self.decide("phase_advanced", phase=phase, devices=self.plan.phases[phase], reason=why)  # type: ignore[union-attr]

    def _start_devices(self, now: float) -> None:
        plan = self.plan
        assert plan is not None
        end = plan.phases[int(self.state.get("phase", 0))]
        in_download = self._refill(now)
        for d in plan.targets[:end]:
            if d in self.records:
                continue
            if self._reconcile(d, now):
                continue
            if not self._may_start(in_download):
                return
            if not self.devices.online(d):
                # a command to an offline device would wait for nobody; an offline device is not a failed one
                # either: it is started when it is back, and fails only when it stays away for the plan's device
                # time-out (counted from its turn; an operator restarted counts afresh)
                since = self._offline_at_turn.setdefault(d, now)
                if now - since > plan.device_timeout_s:
                    self.save_record(d, state="failed", kind="went_offline", phase=int(self.state.get("phase", 0)),
                                     started=round(since, 3), finished=round(now, 3),
                                     reason=f"offline from its turn on, for more than {plan.device_timeout_s:g} s")
                    self._dirty = True
                continue
            self._slot(now, in_download)
            in_download += 1
            self._start_one(d, now)

    def _reconcile(self, d: str, now: float) -> bool:
        """A device with no record whose own retained documents show it took this rollout: the broker lost
        its record (killed before it saved it; Mosquitto persists at its autosave interval). Recorded from
        what the device says, never commanded again: True. Its previous version comes from its own facts
        (`bundle.previous` once it committed, else `bundle.committed`); None only where they do not say
        (a fleet rollback then counts any other committed bundle as back)."""
        plan = self.plan
        assert plan is not None
        status = self.devices.status.get(d) or {}
        runs = plan.artifact.names(FactsRow(d, self.devices.facts.get(d) or {}, {}).committed())
        if status.get("update") != plan.id and not runs:
            return False
        phase = int(self.state.get("phase", 0))
        prior = prior_version(self.devices.facts.get(d) or {}, bool(runs))
        if status.get("update") == plan.id:  # its verdict (or the time-out, from now) decides, as for any start
            self.save_record(d, state="started", phase=phase, started=round(now, 3), commanded=round(now, 3),
                             reconciled=True, previous=prior)
        else:
            self.save_record(d, state="committed", kind="committed", phase=phase, started=round(now, 3),
                             finished=round(now, 3), reconciled=True, previous=prior,
                             reason=f"its facts show {plan.artifact.name} v{plan.artifact.version} committed; "
                                    "no record of its start was kept")
        self.decide("reconciled", device=d, status=status.get("state"), committed=runs)
        return True

    def _refill(self, now: float) -> int:
        """Age the rate window, refill the token bucket; the devices now counted against the download cap."""
        plan = self.plan
        assert plan is not None
        self._starts = [t for t in self._starts if now - t < 60.0]
        rate = plan.rate_per_min / 60.0
        self._tokens = min(max(1.0, rate), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        return sum(1 for d, r in self.records.items()
                   if r.get("state") == "started" and downloading(plan, self.devices.status.get(d)))

    def _may_start(self, in_download: int) -> bool:
        plan = self.plan
        assert plan is not None
        return self._tokens >= 1.0 and len(self._starts) < plan.rate_per_min and in_download < plan.max_downloads

    def _slot(self, now: float, in_download: int) -> bool:
        """Take one start from the caps (rate window, token bucket, downloads); False when they are full."""
        if not self._may_start(in_download):
            return False
        self._tokens -= 1.0
        self._starts.append(now)
        return True

    def _start_one(self, device: str, now: float) -> None:
        plan = self.plan
        assert plan is not None
        com = FactsRow(device, self.devices.facts.get(device) or {}, {}).committed()
        self.save_record(device, state="started", phase=int(self.state.get("phase", 0)), started=round(now, 3),
                         previous={"name": com.get("name"), "version": com.get("version")} if com else None)
        self._command(device)
        self._dirty = True

    def _command(self, device: str) -> None:
        """The update command, acknowledged by the broker, then `commanded` in the device's record: what a
        resumed operator reads to tell a command that went out from one that never did."""
        plan = self.plan
        assert plan is not None
        a = plan.artifact
        self.devices.replies.pop(device, None)
        self.client.publish(f"{self.devices.root}{device}/cmd/update",
                            {"url": self.state.get("url") or a.url, "sha256": a.sha256, "id": plan.id}, retain=False)
        self.save_record(device, commanded=round(self.clock(), 3))
