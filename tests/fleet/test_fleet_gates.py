"""The fleet's pure core: phases, device outcomes, the abort line, the phase gate on proven figures,
facts and targeting. No broker: plain values in, decisions out."""

from __future__ import annotations

import pytest

from agent.fleet.facts import (
    FactsRow,
    device_facts,
    fidelity_margin,
    parse_bundle_id,
    parse_where,
)
from agent.fleet.gates import abort_reason, judge_phase, observe, percentile
from agent.fleet.plan import (
    Artifact,
    Gates,
    Plan,
    phase_ends,
    select_targets,
    start_order,
)

ART = Artifact("http://127.0.0.1:1/v2.tar.gz", "ab" * 32, "digits", 2)


def plan(n: int = 10, **kw) -> Plan:
    return Plan(id="r1", artifact=ART, targets=tuple(f"d{i}" for i in range(n)), phases=phase_ends(n, 2, [50]), **kw)


def facts(version: int = 2, margin: float = 0.02, p95: float = 5.0, budget: float = 50.0, accel: str | None = None,
          ts: float = 100.0) -> dict:
    report = {"passed": True, "providers": [{"name": "CPUExecutionProvider", "usable": True}],
              "selected": {"provider": accel or "CPUExecutionProvider", "variant": "int8", "precision": "int8"},
              "candidates": [{"provider": accel or "CPUExecutionProvider", "variant": "int8", "passed": True,
                              "latency": {"p95_ms": p95, "budget_ms": budget},
                              "fidelity": {"metrics": {"top1_agreement": 0.98 + margin}, "bounds": {"min_top1_agreement": 0.98}},
                              "reproduction": {"tolerance": {"abs_diff": 1e-4, "bound": 1e-3}}}]}
    return device_facts(device_id="d", session=3, labels={"site": "north"}, versions={"agent": "0.9", "onnxruntime": "1.2"},
                        report=report, effective=[accel or "CPUExecutionProvider"], current=f"digits-v{version}-0123456789ab",
                        committed=f"digits-v{version}-0123456789ab", active=None, last_failure=None, ts=ts)


def test_phases_are_cumulative_and_end_with_every_target() -> None:
    assert phase_ends(200, 10, [25, 60]) == (10, 50, 120, 200)
    assert phase_ends(100, "5%", ramp=3) == (5, 15, 45, 100)
    assert phase_ends(3, 10, [50]) == (3,)
    with pytest.raises(ValueError, match="ramp"):
        phase_ends(10, 1, ramp=1.0)


def test_start_order_is_stable_and_the_canary_preference_comes_first() -> None:
    rows = {f"d{i}": FactsRow(f"d{i}", {"labels": {"group": "real" if i in (7, 8) else "sim"}}, {}) for i in range(10)}
    order = start_order("r1", list(rows), [("group", "real")], rows)
    assert set(order[:2]) == {"d7", "d8"} and order == start_order("r1", list(rows), [("group", "real")], rows)
    assert start_order("r1", list(rows)) != start_order("r2", list(rows))


def test_commit_counts_only_once_the_facts_show_it_and_the_device_is_online() -> None:
    p = plan()
    st = {"update": "r1", "state": "committed", "ts": 100.0}
    assert observe(p, 0, 1, st, facts(version=1), {"state": "online"}, None) is None  # facts not yet after the commit
    assert observe(p, 0, 1, st, facts(), {"state": "offline"}, None) is None  # in flight: its link dropped, not it
    assert observe(p, 0, 1, st, facts(), {"state": "online"}, None).kind == "committed"
    old = {"update": "r0", "state": "committed", "ts": 100.0}  # another rollout's retained status
    assert observe(p, 0, 1, old, facts(), {"state": "online"}, None) is None


def test_a_device_whose_link_drops_mid_update_stays_in_flight_until_its_time_out() -> None:
    # the fault: the last will during an update was a final `went_offline` verdict, though the device went
    # on and committed (a 15 s Wi-Fi blip with keepalive 10 s)
    p = plan(device_timeout_s=60)
    off, on = {"state": "offline", "session": 2}, {"state": "online", "session": 3}
    assert observe(p, 0, 20, {"update": "r1", "state": "selftest"}, facts(1), off, None) is None
    back = observe(p, 0, 40, {"update": "r1", "state": "committed", "ts": 39.0}, facts(ts=39.5), on, None)
    assert back is not None and back.kind == "committed"
    late = observe(p, 0, 61, {"update": "r1", "state": "selftest"}, facts(1), off, None)
    assert late is not None and (late.state, late.kind) == ("failed", "went_offline") and "60 s" in late.reason


def test_each_failure_kind_is_named() -> None:
    p = plan(device_timeout_s=60)
    on = {"state": "online"}
    rej = observe(p, 0, 1, {"update": "r1", "state": "rejected", "reason": "self-test failed on this device: x"}, facts(1), on, None)
    assert (rej.kind, rej.provider) == ("rejected_selftest", "CPUExecutionProvider")
    assert observe(p, 0, 1, {"update": "r1", "state": "rejected", "reason": "hash mismatch"}, None, on, None).kind == "rejected"
    assert observe(p, 0, 1, {"update": "r1", "state": "rolled_back", "reason": "p"}, None, on, None).kind == "rolled_back"
    assert observe(p, 0, 61, {"update": "r1", "state": "selftest"}, None, on, None).kind == "timed_out"
    assert observe(p, 0, 1, None, None, on, {"command": "update", "ok": False, "error": "busy"}).kind == "refused"
    assert observe(p, 0, 59, {"update": "r1", "state": "selftest"}, None, on, None) is None


def test_busy_from_a_device_working_on_this_rollout_is_in_flight_not_refused() -> None:
    # the answer to a command sent again on resume, when the first one did arrive
    p, on = plan(), {"state": "online"}
    busy = {"command": "update", "ok": False, "busy": True, "error": "busy: update state is receiving"}
    assert observe(p, 0, 1, {"update": "r1", "state": "downloading"}, None, on, busy) is None
    assert observe(p, 0, 1, {"update": "r0", "state": "downloading"}, None, on, busy).kind == "refused"
    assert observe(p, 0, 1, None, None, on, busy).kind == "refused"


def test_abort_fires_at_the_threshold_only_after_the_minimum_count() -> None:
    p = plan(gates=Gates(abort_failure_pct=20, abort_min_finished=10))
    assert abort_reason(9, 9, p) is None  # under the minimum count, whatever the rate
    assert abort_reason(10, 1, p) is None
    assert "2 of 10" in abort_reason(10, 2, p)


def test_the_gate_holds_on_fidelity_p10_under_the_floor_latency_and_accelerator_fallback() -> None:
    p = plan(previous={"d0": "CUDAExecutionProvider"})
    recs = {f"d{i}": {"state": "committed"} for i in range(2)}
    on = {"d0": True, "d1": True}
    ok = judge_phase(p, 0, recs, {"d0": facts(accel="CUDAExecutionProvider"), "d1": facts()}, on)
    assert ok.passed, ok.summary()
    low = judge_phase(p, 0, recs, {"d0": facts(accel="CUDAExecutionProvider", margin=-0.01), "d1": facts()}, on)
    assert not low.passed and "fidelity_margin_p10 FAILED" in low.summary()
    slow = judge_phase(p, 0, recs, {"d0": facts(accel="CUDAExecutionProvider"), "d1": facts(p95=80)}, on)
    assert "latency_ratio_p95 FAILED" in slow.summary()
    fell = judge_phase(p, 0, recs, {"d0": facts(), "d1": facts()}, on)  # d0 ran on CUDA before, on CPU now
    assert "accelerator_fallbacks FAILED: 1 vs 0 (d0)" in fell.summary()
    gone = judge_phase(p, 0, recs, {"d0": facts(accel="CUDAExecutionProvider"), "d1": facts()}, {"d0": True})
    assert "committed_reachable FAILED" in gone.summary()
    few = judge_phase(p, 0, {"d0": {"state": "committed"}, "d1": {"state": "failed"}}, {"d0": facts(accel="CUDAExecutionProvider")}, on)
    assert "committed_pct FAILED: 50.0 vs 80.0" in few.summary()


def test_a_gate_with_no_proof_figures_fails_closed() -> None:
    p = plan()
    recs = {"d0": {"state": "committed"}, "d1": {"state": "committed"}}
    bare = {"d0": {"bundle": {}}, "d1": {"bundle": {}}}
    assert not judge_phase(p, 0, recs, bare, {"d0": True, "d1": True}).passed


def test_facts_carry_the_proof_figures_against_the_authors_floor() -> None:
    f = facts(margin=0.015, p95=10, budget=40)
    assert f["proof"]["fidelity"]["margin"] == pytest.approx(0.015)
    assert f["proof"]["latency_ratio"] == 0.25 and f["proof"]["reproduction_margin"] == pytest.approx(0.9)
    assert f["bundle"]["committed"] == {"name": "digits", "version": 2, "sha": "0123456789ab"}
    assert fidelity_margin({"metrics": {"error": 0.1}, "bounds": {"max_error": 0.3}}) == pytest.approx(0.2)
    assert parse_bundle_id("my-model-v12-abcdef012345") == {"name": "my-model", "version": 12, "sha": "abcdef012345"}


def test_where_filters_labels_and_providers_and_targets_skip_earlier_rejections() -> None:
    rows = {"a": FactsRow("a", facts(version=1), {"state": "online"}),
            "b": FactsRow("b", {**facts(version=1), "labels": {"site": "south"}}, {"state": "online"}),
            "c": FactsRow("c", facts(version=2), {"state": "online"}),
            "d": FactsRow("d", facts(version=1), {"state": "online"})}
    where = parse_where(["site=north", "provider=CPUExecutionProvider"])
    chosen, skipped = select_targets(rows, where, ART, rejected={"d": "CPUExecutionProvider"})
    assert chosen == ["a"] and "already at" in skipped["c"] and "rejected this bundle" in skipped["d"]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_where(["north"])


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5, 1, 3, 2, 4], 10) == 1 and percentile([5, 1, 3, 2, 4], 95) == 5 and percentile([], 50) is None


def test_a_late_last_will_of_the_previous_connection_does_not_hide_the_live_session() -> None:
    from agent.fleet.devices import DeviceCache

    cache = DeviceCache("edge")
    cache.take("edge/d/availability", {"state": "online", "session": 6})
    cache.take("edge/d/availability", {"state": "offline", "session": 5})  # session 5's will, late
    assert cache.online("d")
    cache.take("edge/d/availability", {"state": "offline", "session": 6})  # session 6's own will
    assert not cache.online("d")
    cache.take("edge/d/facts", {"session": 7, "bundle": {"committed": {"version": 2}}})
    cache.take("edge/d/facts", {"session": 6, "bundle": {"committed": {"version": 1}}})
    assert cache.facts["d"]["bundle"]["committed"]["version"] == 2


def test_a_device_document_delivered_out_of_order_never_replaces_a_newer_one() -> None:
    # the fault (an aedes cluster on Redis): a device's facts from before its commit arrived after the facts
    # from after it, the operator kept the older ones, and the rollout waited for that device until its time-out
    from agent.fleet.devices import DeviceCache

    c = DeviceCache("edge")
    new = {"session": 3, "ts": 20.0, "bundle": {"committed": {"name": "m", "version": 2}}}
    c.take("edge/d/facts", new)
    c.take("edge/d/facts", {"session": 3, "ts": 19.5, "bundle": {"committed": {"name": "m", "version": 1}}})
    assert c.facts["d"] is new
    c.take("edge/d/update/status", {"update": "r1", "state": "committed", "ts": 20.0})
    c.take("edge/d/update/status", {"update": "r1", "state": "probation", "ts": 19.9})
    assert c.status["d"]["state"] == "committed"
    c.take("edge/d/update/status", {"update": "r2", "state": "downloading", "ts": 5.0})  # another update: its own clock
    assert c.status["d"]["update"] == "r2"
    c.take("edge/d/facts", {"session": 4, "ts": 1.0})  # a newer session wins whatever its clock says
    assert c.facts["d"]["session"] == 4
