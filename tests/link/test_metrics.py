"""Prometheus /metrics from a running agent, read with prometheus_client's own parser; health, /metrics
and the report page show the same self-test figures; nothing optional is imported on the serving path."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from agentproc import DEMO_FRAMES, demo_config
from brokers import free_port
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _scrape(port: int) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    for s in fams[family]:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample or family} {labels} not in {fams.get(family)}")


def _try_scrape(port: int) -> dict | None:
    try:
        return _scrape(port)
    except OSError:
        return None


def test_metrics_counters_move_with_served_frames_and_agree_with_the_selftest_report(tmp_path: Path,
                                                                                      agent_process) -> None:
    port = free_port()
    src = f"folder:{DEMO_FRAMES}"  # the source's name, as health reports it
    agent = agent_process(demo_config(tmp_path, source={"max_fps": 100}, output={"stdout": False, "health_interval_s": 1},
                                      metrics={"listen": f"127.0.0.1:{port}"})).start()
    try:
        box: dict = {}
        assert wait_until(lambda: (box.update(f=_try_scrape(port)) or box["f"]) and "edge_agent_frames_out" in box["f"]
                          and _value(box["f"], "edge_agent_frames_out", source=src) > 5, timeout=90), \
            "no frames counted on /metrics"
        first = box["f"]
        assert wait_until(lambda: _value(_scrape(port), "edge_agent_frames_out", source=src)
                          > _value(first, "edge_agent_frames_out", source=src) + 20, timeout=30)
        second = _scrape(port)
        out1 = _value(second, "edge_agent_frames_out", "edge_agent_frames_out_total", source=src)
        assert _value(second, "edge_agent_frames_in", "edge_agent_frames_in_total", source=src) >= out1
        # every published frame went through the total-latency histogram once
        count = _value(second, "edge_agent_stage_latency_seconds", "edge_agent_stage_latency_seconds_count", stage="total")
        inf = _value(second, "edge_agent_stage_latency_seconds", "edge_agent_stage_latency_seconds_bucket",
                     stage="inference", le="+Inf")
        # read a moment apart within one scrape (inference's histogram before total's, while frames flow at
        # 100 fps): a scrape thread that loses the GIL between them sees a few more totals, never fewer
        assert count >= out1 - 1 and inf >= count - 10
        assert _value(second, "edge_agent_serving") == 1
        # the candidate the self-test selected (int8 alone; fp32 when load made it the faster by the margin:
        # a hard-coded int8 failed so at load 11), one sample for it and none for another
        selected = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())["selected"]
        assert selected["provider"] == "CPUExecutionProvider"
        assert _value(second, "edge_agent_selected_candidate", bundle="digits-classifier", variant=selected["variant"],
                      provider="CPUExecutionProvider") == 1
        assert len(second["edge_agent_selected_candidate"]) == 1
        assert _value(second, "edge_agent_selftest_passed", bundle="digits-classifier", version="1") == 1
        assert _value(second, "process_resident_memory_bytes") > 50e6
        assert _value(second, "edge_agent_update_state", edge_agent_update_state="idle") == 1
        assert "edge_agent_mqtt_connected" not in second  # MQTT off: no made-up gauge
        # the same figures as the report: from the same report values, not re-measured
        report = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
        assert _value(second, "edge_agent_selftest_last_run_timestamp_seconds") == pytest.approx(
            __import__("datetime").datetime.fromisoformat(report["created"]).timestamp(), abs=1e-3)
        for c in report["candidates"]:
            got = _value(second, "edge_agent_selftest_latency_p95_seconds", provider=c["provider"], variant=c["variant"])
            assert got == pytest.approx(c["latency"]["p95_ms"] / 1000, rel=1e-9)
    finally:
        rc = agent.stop()
    assert rc == 0, agent.log_text()[-3000:]


def test_bad_metrics_listen_is_refused_naming_the_key() -> None:
    from agent.errors import ConfigError
    from agent.link.prometheus import parse_listen

    assert parse_listen("127.0.0.1:9108") == ("127.0.0.1", 9108)
    assert parse_listen("[::1]:9108") == ("::1", 9108)
    for bad in ("9108", "host:", "host:99999", "host:http"):
        with pytest.raises(ConfigError, match="metrics.listen"):
            parse_listen(bad)


def test_serving_path_imports_neither_prometheus_client_nor_matplotlib() -> None:
    code = ("import sys, agent.service.daemon, agent.link.prometheus, agent.link.health\n"
            "from agent.service.daemon import Agent\n"
            "print(','.join(m for m in ('prometheus_client', 'matplotlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@functools.lru_cache(maxsize=1)
def _real_report() -> dict:
    """A real self-test report of the demo bundle on this machine (the report production writes: a synthetic
    one carried a `budget_ms` production never wrote, so the budget metric looked exported when it was not)."""
    state = Path(tempfile.mkdtemp(prefix="edge-agent-metrics-report-"))
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle",
                          str(ROOT / "models" / "digits-classifier"), "--state-dir", str(state), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    shutil.rmtree(state, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _full_health() -> dict:
    """A health document with every part present (serving, MQTT on, an update, a real self-test report)."""
    from agent.link.health import build_health

    report = _real_report()
    return build_health(
        device_id="d", uptime_s=5, session=2, interval_s=10, serving=True, not_serving_reason=None,
        engine={"bundle": "b", "version": 3, "label": "1", "variant": "int8", "provider": "CPUExecutionProvider",
                "effective_providers": ["CPUExecutionProvider"]},
        placement={"CPUExecutionProvider": 10}, selftest=report,
        pipeline={"frames_in": 7, "frames_out": 6, "dropped": 1, "bad_frames": 0, "inference_errors": 0},
        source={"name": "cam", "reconnects": 1, "last_frame_age_s": 0.1},
        outbox={"depth": 3, "on_disk": 1, "inflight": 1, "oldest_age_s": 0.5, "dropped": 0, "sent": 9, "acked": 8},
        process={"rss_mb": 1.0}, mqtt_connected=True, update={"update": "u1", "state": "probation", "ts": 1.0})


def test_every_metric_the_grafana_dashboard_queries_is_exported() -> None:
    import re

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.process_collector import ProcessCollector

    from agent.link.prometheus import families
    from agent.serving.metrics import PipelineMetrics

    pm = PipelineMetrics()
    pm.observe("total", 3.0)

    class One:
        def collect(self):
            return families(_full_health(), pm)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    ProcessCollector(registry=reg)
    text = generate_latest(reg).decode()
    exported = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", text, re.M))
    dash = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    queried = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"\b((?:edge_agent|process)_[a-z0-9_]+)", t["expr"])}
    assert queried and not queried - exported, f"the dashboard queries metrics the agent does not export: {queried - exported}"
    assert 'edge_agent_update_state{edge_agent_update_state="probation"} 1.0' in text
    assert "edge_agent_mqtt_connected 1.0" in text and "edge_agent_outbox_depth_messages 3.0" in text
    assert 'edge_agent_stage_latency_seconds_bucket{le="0.005",stage="total"} 1.0' in text
    # the Grafana panel "p95 against its budget" needs a budget sample, from what production writes
    assert 'edge_agent_selftest_latency_budget_seconds{provider="CPUExecutionProvider",variant="int8"} 0.05' in text


def test_health_metrics_and_report_page_show_the_same_selftest_figures_from_a_running_agent(tmp_path: Path,
                                                                                            agent_process) -> None:
    """One agent with MQTT and /metrics: its retained health, its /metrics and the page rendered from its
    retained self-test report carry the same verdict, run time and p95 per candidate."""
    from brokers import Broker, Collector

    broker = Broker(tmp_path / "broker").start()
    port = free_port()
    cfg = demo_config(tmp_path, device_id="cam-9", source={"max_fps": 50},
                      output={"stdout": False, "health_interval_s": 1}, mqtt={"enabled": True, "port": broker.port},
                      metrics={"listen": f"127.0.0.1:{port}"})
    sub = Collector(broker.port, ["edge/cam-9/health", "edge/cam-9/selftest"])
    agent = agent_process(cfg, log_args=("--log-level", "warning")).start()
    try:
        def serving_health() -> dict | None:
            docs = [json.loads(m.payload) for m in sub.on("edge/cam-9/health")]
            docs = [d for d in docs if d.get("serving") and (d.get("mqtt") or {}).get("connected")]
            return docs[-1] if docs else None

        assert wait_until(lambda: serving_health() is not None, timeout=90), "no health while serving"
        health = serving_health()
        fams = _scrape(port)
        assert _value(fams, "edge_agent_mqtt_connected") == 1
        fig = health["selftest"]
        assert fig["verdict"] == "pass" and _value(fams, "edge_agent_selftest_passed") == 1
        assert _value(fams, "edge_agent_selftest_last_run_timestamp_seconds") == pytest.approx(fig["created_ts"], abs=1e-3)
        page_path = tmp_path / "page.html"
        run = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "report", "--broker",
                              f"127.0.0.1:{broker.port}", "--device", "cam-9", "--out", str(page_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        page = page_path.read_text()
        for c in fig["candidates"]:
            prov, _, variant = c["key"].partition(":")
            assert _value(fams, "edge_agent_selftest_latency_p95_seconds", provider=prov, variant=variant) == \
                pytest.approx(c["p95_ms"] / 1000, rel=1e-9)
            assert f"{c['p95_ms']:.3g} ms" in page
            assert _value(fams, "edge_agent_selftest_candidate_passed", provider=prov, variant=variant,
                          verdict=c["verdict"]) == (1 if c["verdict"] == "pass" else 0)
    finally:
        rc = agent.stop()
        sub.close()
        broker.stop()
    assert rc == 0, agent.log_text()[-3000:]
