"""Every verdict reaches every channel: a pinned below-floor or degraded candidate, and the serving
audit's counters, are in /metrics (the families the metrics server renders) and in STATUS."""

from __future__ import annotations

import json

from agent.link.prometheus import families
from agent.service.audit import loud_state


def _values(health: dict) -> dict[str, float]:
    out = {}
    for fam in families(health, None):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_pinned_below_floor_degraded_and_audit_drift_are_in_metrics() -> None:
    health = {"uptime_s": 1, "serving": True,
              "selftest": {"passed": True, "pinned_below_floor": True, "degraded": None, "bundle": {}},
              "audit": {"state": "degraded", "canary_runs": 7, "canary_failures": 2, "live_samples": 3,
                        "live_windows": 1, "live_drift": 0}}
    v = _values(health)
    assert v["edge_agent_pinned_below_floor"] == 1
    assert v["edge_agent_degraded{reason=audit_drift}"] == 1 and v["edge_agent_degraded{reason=too_slow}"] == 0
    assert v["edge_agent_audit_canary_runs_total"] == 7 and v["edge_agent_audit_canary_failures_total"] == 2
    healthy = _values({"uptime_s": 1, "serving": True, "selftest": {"passed": True, "bundle": {}}, "audit": {"state": "ok"}})
    assert healthy["edge_agent_pinned_below_floor"] == 0 and healthy["edge_agent_degraded{reason=audit_drift}"] == 0


def test_status_says_what_serves_loudly() -> None:
    assert loud_state({"pinned_below_floor": True}, None) == "PINNED BELOW FLOOR"
    drift = {"degraded": {"check": "canary", "candidate": "CPUExecutionProvider:int8"}}
    assert loud_state({"degraded": "too slow"}, drift) == ("DEGRADED: canary audit of CPUExecutionProvider:int8 "
                                                          "drifted; DEGRADED: too slow for its budget")
    assert loud_state({"passed": True}, {"state": "ok", "degraded": None}) is None


def test_the_last_audit_is_in_metrics_with_its_time_and_verdict() -> None:
    health = {"uptime_s": 1, "serving": True, "selftest": {"passed": True, "bundle": {}},
              "audit": {"state": "degraded", "canary_runs": 3,
                        "last": {"canary": {"sample": 2, "passed": False, "at_unix": 1796170000.5},
                                 "live": {"frames": 8, "passed": True, "at_unix": 1796169990.0}}}}
    v = _values(health)
    assert v["edge_agent_audit_last_check_timestamp_seconds{check=canary}"] == 1796170000.5
    assert v["edge_agent_audit_last_check_passed{check=canary}"] == 0
    assert v["edge_agent_audit_last_check_passed{check=live}"] == 1
    # before the first check: no made-up sample
    fresh = _values({"uptime_s": 1, "serving": True, "selftest": {"passed": True, "bundle": {}},
                     "audit": {"state": "ok", "last": {}}})
    assert not any(k.startswith("edge_agent_audit_last_check") for k in fresh)


def test_sensor_stream_losses_and_backlog_are_in_metrics_per_stream() -> None:
    """Issue 44: lost samples were in no counter; now every stream's losses and backlog are exported."""
    streams = {"lost_datagrams": 12, "streams": {"udp:0.0.0.0:9000/10.0.0.7:40112": {
        "lost_samples": 3200, "dropped_samples": 17, "backlog_s": 1.5, "oldest_unserved_age_s": 1.75}}}
    v = _values({"uptime_s": 1, "serving": True, "source": {"name": "udp:0.0.0.0:9000", "streams": streams}})
    labels = "{source=udp:0.0.0.0:9000,stream=udp:0.0.0.0:9000/10.0.0.7:40112}"
    assert v["edge_agent_sensor_lost_samples_total" + labels] == 3200
    assert v["edge_agent_sensor_dropped_samples_total" + labels] == 17
    assert v["edge_agent_sensor_backlog_seconds" + labels] == 1.5
    assert v["edge_agent_sensor_oldest_unserved_age_seconds" + labels] == 1.75
    assert v["edge_agent_sensor_lost_datagrams_total{source=udp:0.0.0.0:9000}"] == 12


DEGRADED_REPORT = {"passed": True, "too_slow": True, "bundle": {"name": "digits", "version": 1},
                   "selected": {"provider": "CPUExecutionProvider", "variant": "fp32", "precision": "fp32"},
                   "degraded": "serving CPUExecutionProvider:fp32 degraded: p95 63.00 ms stays over budget 50 ms",
                   "candidates": []}


def test_a_proof_serving_degraded_is_never_shown_as_passed() -> None:
    """Fault: with when_too_slow: degraded, health said passed: true, verdict: pass and /metrics
    edge_agent_selftest_passed 1 beside edge_agent_degraded{reason="too_slow"} 1."""
    from agent.link.health import selftest_figures

    fig = selftest_figures(DEGRADED_REPORT)
    assert (fig["passed"], fig["verdict"]) == (False, "degraded")
    v = _values({"uptime_s": 1, "serving": True, "selftest": fig, "audit": {"state": "ok"}})
    assert v["edge_agent_selftest_passed{bundle=digits,version=1}"] == 0
    assert v["edge_agent_selftest_verdict{verdict=degraded}"] == 1
    assert v["edge_agent_selftest_verdict{verdict=pass}"] == 0 and v["edge_agent_degraded{reason=too_slow}"] == 1
    pinned = selftest_figures({**DEGRADED_REPORT, "degraded": None, "pinned_below_floor": True})
    assert pinned["verdict"] == "degraded"
    clean = selftest_figures({**DEGRADED_REPORT, "degraded": None, "too_slow": False})
    assert (clean["passed"], clean["verdict"]) == (True, "pass")
    assert _values({"uptime_s": 1, "selftest": clean})["edge_agent_selftest_verdict{verdict=pass}"] == 1


def test_drift_seen_by_the_audit_makes_the_health_verdict_degraded() -> None:
    from agent.link.health import audited, selftest_figures

    clean = selftest_figures({**DEGRADED_REPORT, "degraded": None, "too_slow": False})
    assert audited(clean, {"state": "degraded"})["verdict"] == "degraded"
    assert audited(clean, {"state": "degraded"})["passed"] is False
    assert audited(clean, {"state": "ok"})["verdict"] == "pass"


def test_monitor_shows_degraded_not_pass() -> None:
    from agent.link.health import selftest_figures
    from agent.link.monitor import DeviceView, render

    view = DeviceView("cam-1", {"state": "online"}, {"ts": 0, "serving": True,
                                                      "selftest": selftest_figures(DEGRADED_REPORT)})
    row = view.row(0.0)
    assert row["verdict"] == "degraded"
    assert "degraded" in render([row]).splitlines()[1]


def test_home_assistants_self_test_sensor_says_degraded() -> None:
    """The discovery template rendered as Home Assistant renders it (Jinja): it said fail or pass from `passed`."""
    import jinja2

    from agent.config import Config
    from agent.link.discovery import discovery_messages
    from agent.link.health import selftest_figures
    from agent.link.topics import Topics

    msgs = {k.split("/")[-2]: json.loads(v) for k, v in discovery_messages(Config(), Topics("edge/dev/")).items()}
    template = jinja2.Environment().from_string(next(m for k, m in msgs.items() if k.endswith("verdict"))
                                                ["value_template"])
    assert template.render(value_json={"selftest": selftest_figures(DEGRADED_REPORT)}) == "degraded"
    assert template.render(value_json={"selftest": {}}) == "none"
