"""`fleet rollback`: every device that runs a rollout's bundle sent back to its previous committed bundle with
its own `rollback` command, under the rollback's own pace and abort line, each outcome kept in its record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from agent.errors import RolloutError
from agent.fleet.facts import FactsRow, prior_version
from agent.fleet.rollout_records import HEARTBEAT_S, RolloutRecords


@dataclass(frozen=True)
class RollbackCaps:
    """`fleet rollback`'s own pace and abort line (the plan's rate and abort line by default)."""

    rate_per_min: float
    max_in_flight: int
    abort_failure_pct: float
    abort_min_finished: int


class FleetRollback:
    """`fleet rollback`: every device that runs the rollout's bundle goes back to its previous committed
    bundle with the device's own `rollback` command (kept locally: no download), at the plan's rate cap.

    Which devices run it is read from their own retained facts, not only from the operator's records: a
    device recorded failed (timed out while its link was down) that committed afterwards runs the bundle
    as surely as one recorded committed."""

    def __init__(self, op: RolloutRecords, caps: RollbackCaps | None = None):
        self.op = op
        self.update_id = f"{op.t.id}-rollback"
        plan = op.plan
        assert plan is not None
        # its own caps; by default the plan's (rate, downloads in flight, the abort line)
        self.caps = caps or RollbackCaps(plan.rate_per_min, plan.max_downloads, plan.gates.abort_failure_pct,
                                         plan.gates.abort_min_finished)

    def run(self, max_s: float | None = None) -> dict[str, Any]:
        op, plan = self.op, self.op.plan
        assert plan is not None
        if op.state.get("status") not in ("aborted", "done", "held", "awaiting_approval", "paused", "rolling_back",
                                          "rollback_aborted"):
            raise RolloutError(f"rollout {plan.id} is {op.state.get('status')}: pause or abort it before a fleet rollback")
        if op.state.get("status") == "aborted" and op.counts()["in_flight"]:
            raise RolloutError(f"rollout {plan.id} still has {op.counts()['in_flight']} devices in flight; "
                               "wait for their verdicts (fleet rollout status) before rolling back")
        op.state["status"] = "rolling_back"
        todo = self.targets()
        caps = self.caps
        op.decide("rollback_started", devices=len(todo), rate_per_min=caps.rate_per_min,
                  max_in_flight=caps.max_in_flight, abort_pct=caps.abort_failure_pct, abort_min=caps.abort_min_finished)
        op.save_state()
        end = None if max_s is None else time.monotonic() + max_s
        interval = 60.0 / caps.rate_per_min
        last = 0.0
        stopped = False  # the rollback's own abort line was crossed: nothing more starts
        while True:
            op.drain()
            now = op.clock()
            pending = False
            states = [(op.records[d].get("rollback") or {}).get("state") for d in todo]
            in_flight = states.count("started")
            for d in todo:
                rb = (op.records[d].get("rollback") or {})
                st = rb.get("state")
                if st is None and not stopped:
                    pending = True
                    if now - last >= interval and in_flight < caps.max_in_flight:
                        in_flight += 1
                        op.save_record(d, rollback={"state": "started", "started": round(now, 3)})
                        op.devices.replies.pop(d, None)
                        op.client.publish(f"{op.devices.root}{d}/cmd/rollback", {"id": self.update_id}, retain=False,
                                          wait=False)
                        last = now
                elif st == "started":
                    pending = True
                    self._observe(d, rb, now)
                    if not stopped and (op.records[d].get("rollback") or {}).get("state") == "failed":
                        stopped = self._check_abort(todo)
            if op._dirty or now - op._beat >= HEARTBEAT_S:
                op.save_state()
            if not pending or (end is not None and time.monotonic() > end):
                break
            time.sleep(op.tick_s)
        done = sum(1 for d in todo if (op.records[d].get("rollback") or {}).get("state") == "done")
        untouched = sum(1 for d in todo if not (op.records[d].get("rollback") or {}).get("state"))
        op.state["status"] = "rollback_aborted" if stopped else "rolled_back"
        op.decide("rolled_back", devices=len(todo), returned=done, failed=len(todo) - done - untouched,
                  not_started=untouched)
        op.save_state(release=True)
        return op.state

    def _check_abort(self, todo: list[str]) -> bool:
        """The rollback's own abort line: a bad previous bundle must not go back fleet-wide either."""
        op, caps = self.op, self.caps
        states = [(op.records[d].get("rollback") or {}).get("state") for d in todo]
        finished, failed = states.count("done") + states.count("failed"), states.count("failed")
        if finished >= caps.abort_min_finished and 100.0 * failed / finished >= caps.abort_failure_pct:
            op.decide("rollback_aborted", finished=finished, failed=failed,
                      reason=f"{failed} of {finished} finished rollbacks failed (>= {caps.abort_failure_pct:g} % after "
                             f"{caps.abort_min_finished}); no more devices are sent back")
            return True
        return False

    def targets(self) -> list[str]:
        """Every device of the plan that its facts show committed to the rollout's bundle, and every one
        recorded committed (its facts may not have arrived), in the plan's order. A device with no record
        (the broker lost it) gets one, its previous version from its facts."""
        op, plan = self.op, self.op.plan
        assert plan is not None
        todo = []
        for d in plan.targets:
            rec = op.records.get(d)
            runs = plan.artifact.names(FactsRow(d, op.devices.facts.get(d) or {}, {}).committed())
            if runs or (rec or {}).get("state") == "committed":
                if rec is None:
                    op.save_record(d, state="committed", kind="found_by_facts",
                                   previous=prior_version(op.devices.facts.get(d) or {}, bool(runs)),
                                   reason="its facts show the rollout's bundle committed; no record was kept")
                todo.append(d)
        return todo

    def _observe(self, d: str, rb: dict[str, Any], now: float) -> None:
        op = self.op
        st = op.devices.status.get(d) or {}
        prev = op.records[d].get("previous") or {}
        com = ((op.devices.facts.get(d) or {}).get("bundle") or {}).get("committed") or {}
        if st.get("update") == self.update_id and st.get("state") == "committed":
            back = (com.get("name"), com.get("version")) == (prev.get("name"), prev.get("version")) if prev \
                else not op.plan.artifact.names(com)  # type: ignore[union-attr]
            if back:
                op.save_record(d, rollback={**rb, "state": "done", "finished": round(now, 3)})
        elif st.get("update") == self.update_id and st.get("state") in ("rejected", "rolled_back"):
            op.save_record(d, rollback={**rb, "state": "failed", "reason": str(st.get("reason"))[:300]})
        elif now - float(rb["started"]) > op.plan.device_timeout_s:  # type: ignore[union-attr]
            op.save_record(d, rollback={**rb, "state": "failed", "reason": "timed out"})
