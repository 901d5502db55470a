"""The report page is a Jinja2 template with autoescape (issue 18): every string a report carries is escaped by
the engine, wherever it lands (text, attribute, table cell, the raw JSON); only the page's own SVG is markup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVIL = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"


@pytest.fixture(scope="module")
def real_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("autoescape")
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle",
                          str(ROOT / "models" / "digits-classifier"), "--state-dir", str(d), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_hostile_strings_in_every_part_of_a_report_are_escaped(real_report: dict) -> None:
    from agent.report.page import render_report

    doc = json.loads(json.dumps(real_report))
    doc["bundle"].update(name=EVIL, label=EVIL)
    doc["notes"] = [EVIL]
    doc["reason"] = EVIL
    doc["passed"] = False
    doc["versions"][EVIL] = EVIL
    doc["device"] = {EVIL: EVIL}
    for c in doc["candidates"]:
        c["reasons"] = [EVIL]
        c["variant"] = EVIL
        if c.get("placement"):
            c["placement"]["source"] = EVIL
            c["placement"]["nodes_by_provider"] = {EVIL: 3}
        if c.get("latency_context"):
            c["latency_context"][EVIL] = EVIL
    page = render_report(doc, bundle_root=ROOT / "models" / "digits-classifier")
    assert "<script" not in page and "<img src=x" not in page  # only ever as escaped text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&gt;&lt;img src=x onerror=alert(2)&gt;" in page


def test_the_page_s_own_plots_and_css_are_not_escaped(real_report: dict) -> None:
    from agent.report.page import render_report

    page = render_report(real_report, bundle_root=ROOT / "models" / "digits-classifier")
    assert "<svg" in page and "&lt;svg" not in page
    assert "font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif" in page  # CSS as written
    assert page.count("<img alt='golden sample ") >= 1


def test_the_template_ships_with_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "templates/*.j2" in data["tool"]["setuptools"]["package-data"]["agent.report"]
    assert any(d.startswith("jinja2") for d in data["project"]["optional-dependencies"]["report"])
    assert (ROOT / "agent" / "report" / "templates" / "page.html.j2").is_file()
    assert " jinja2 " in (ROOT / "scripts" / "test.sh").read_text().split("COMMON_DEPS=", 1)[1].split("\n", 1)[0]
