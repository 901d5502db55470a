"""The latency budget reaches the operator (issue 18): a passing candidate's report carries the p95 budget it
was judged against, so /metrics exports edge_agent_selftest_latency_budget_seconds with a sample and the
report page shows it without --bundle (the bundle need not be on the machine that renders the page)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"


@pytest.fixture(scope="module")
def real_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real self-test of a copy of the demo bundle on this machine's CPU, the copy then removed."""
    d = tmp_path_factory.mktemp("budget")
    bundle = d / "digits"
    shutil.copytree(DEMO, bundle)
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle", str(bundle),
                          "--state-dir", str(d / "state"), "--json", "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shutil.rmtree(bundle)  # the page must not read the budget from a manifest
    report = json.loads(out.stdout)
    assert report["passed"]
    return report


def _manifest_budget() -> float:
    from agent.bundle.load import load_bundle

    return load_bundle(DEMO, check_contracts=False).manifest.selftest.budget_for("CPUExecutionProvider")


def test_a_passing_candidate_carries_the_budget_it_was_judged_against(real_report: dict) -> None:
    tested = [c for c in real_report["candidates"] if c["status"] == "tested" and c.get("latency")]
    assert tested and any(c["passed"] for c in tested)
    for c in tested:
        assert c["latency"]["budget_ms"] == _manifest_budget(), c["latency"]


def test_metrics_export_a_budget_sample_for_each_tested_candidate(real_report: dict) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.link.health import build_health
    from agent.link.prometheus import families
    from agent.serving.metrics import PipelineMetrics

    health = build_health(device_id="d", uptime_s=1, session=1, interval_s=10, serving=True, not_serving_reason=None,
                          engine=None, placement=None, selftest=real_report, pipeline=None, source=None, outbox=None,
                          process={}, mqtt_connected=None, update=None)

    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            return families(health, PipelineMetrics())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    text = generate_latest(reg).decode()
    sel = real_report["selected"]
    want = (f'edge_agent_selftest_latency_budget_seconds{{provider="{sel["provider"]}",variant="{sel["variant"]}"}} '
            f'{_manifest_budget() / 1000}')
    assert want in text, [ln for ln in text.splitlines() if "budget" in ln]


def test_the_report_page_shows_the_budget_without_the_bundle(real_report: dict, tmp_path: Path) -> None:
    src = tmp_path / "report.json"
    src.write_text(json.dumps(real_report))
    page = tmp_path / "page.html"
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "report", str(src), "--out", str(page)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert f"<td class=\"num\">{_manifest_budget():.3g} ms</td>" in html  # from the report, not "(manifest)"
    assert "budget (p95)" in html
