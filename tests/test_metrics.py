"""Prometheus /metrics from a running agent, read with prometheus_client's own parser; health, /metrics
and the report page show the same self-test figures; nothing optional is imported on the serving path."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from brokers import free_port
from waiting import end_process, wait_until

ROOT = Path(__file__).resolve().parents[1]


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


def test_metrics_counters_move_with_served_frames_and_agree_with_the_selftest_report(tmp_path: Path) -> None:
    port = free_port()
    src = f"folder:{ROOT / 'models' / 'demo-frames' / 'digits'}"  # the source's name, as health reports it
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "bundle": str(ROOT / "models" / "digits-classifier"),
        "source": {"type": "folder", "path": str(ROOT / "models" / "demo-frames" / "digits"), "loop": True,
                   "max_fps": 100},
        "output": {"stdout": False, "health_interval_s": 1},
        "metrics": {"listen": f"127.0.0.1:{port}"},
    }
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(tmp_path / "agent.yaml")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
        assert count >= out1 - 1 and inf >= count - 4  # scraped a moment apart, never backwards
        assert _value(second, "edge_agent_serving") == 1
        assert _value(second, "edge_agent_selected_candidate", bundle="digits-classifier", variant="int8",
                      provider="CPUExecutionProvider") == 1
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
        end_process(proc)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]


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
