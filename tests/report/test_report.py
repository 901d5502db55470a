"""`edge-agent report`: the self-test report page, rendered from real self-tests and opened in a real
headless browser (Debian's chromium), whose screenshot is kept in the test's temp dir."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.bundle.load import load_bundle
from agent.link.health import build_health, selftest_figures
from agent.proof.selection import SelectionPolicy
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.report.extract import candidate_metrics, sample_views
from agent.report.page import render_report
from agent.testing import rewrite_manifest, scale_initializer

FAST = SelftestOptions(latency_runs=30)
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def edge_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def _selftest(bundle: Path, state: Path) -> dict:
    run_selftest(load_bundle(bundle), state, FAST)
    return json.loads((state / "selftest" / "report.json").read_text())


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_master: Path) -> tuple[Path, Path, dict]:
    """One real self-test of the tiny bundle for the tests that only read its report: (bundle, state dir,
    report). A test that changes the report takes `copy.deepcopy`; one that changes the bundle runs its own."""
    d = tmp_path_factory.mktemp("report-passing")
    bundle = shutil.copytree(tiny_bundle_master, d / "bundle")
    return bundle, d / "state", _selftest(bundle, d / "state")


def _browser(page: Path, shot: Path, tmp: Path, height: int = 2200) -> str:
    """Load the page in headless chromium: the DOM after parsing, and a screenshot."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs it (apt-get install chromium)")
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp / 'chromium-profile'}", "--no-first-run", "--disable-extensions"]
    # one browser start for both: the screenshot file and the DOM on stdout
    dom = subprocess.run([*common, f"--window-size=1200,{height}", f"--screenshot={shot}", "--dump-dom",
                          page.as_uri()], check=True, capture_output=True, text=True, timeout=120).stdout
    assert shot.stat().st_size > 10_000, "the screenshot is empty"
    print(f"screenshot: {shot}")
    return dom


class _Elements(HTMLParser):
    """Counts tags and collects attributes of elements with an id, from the browser's DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.ids: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids[a["id"]] = a


def _parse(dom: str) -> _Elements:
    p = _Elements()
    p.feed(dom)
    return p


def test_passing_bundle_report_opens_in_a_browser_with_plots_thumbnails_and_versions(passing: tuple,
                                                                                     tmp_path: Path) -> None:
    _, state, doc = passing
    assert doc["passed"]
    out = tmp_path / "pass.html"
    assert edge_agent("report", str(state), "--out", str(out)).returncode == 0
    dom = _browser(out, tmp_path / "pass.png", tmp_path)
    el = _parse(dom)
    assert "latency-plot" in el.ids and el.tags.get("svg", 0) >= 1  # the latency histogram, inline
    assert el.tags.get("img", 0) == 8  # one thumbnail per golden sample, embedded
    assert not any(a.get("class") == "card fail" for a in el.ids.values())
    assert "PASS" in dom and "onnxruntime" in dom and doc["versions"]["onnxruntime"] in dom
    assert "CPU:int8" in dom and "CPU:fp32" in dom
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", dom) and "<script" not in dom  # nothing fetched
    sel = selftest_figures(doc)["candidates"][0]
    assert f"{sel['p95_ms']:.3g} ms" in dom  # the same figure health carries


def test_failing_bundle_report_highlights_the_failing_sample_its_reason_and_stage(tiny_bundle: Path,
                                                                                 tmp_path: Path) -> None:
    scale_initializer(tiny_bundle / "model_fp32.onnx", "w2", 1.3)  # tampered weights: parity fails on fp32
    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(latency_budget_ms={"default": 0.001}))
    # no latency re-measurements: 0.001 ms fails anyway (the retries would wait 2 + 4 + 8 s for nothing)
    run_selftest(load_bundle(tiny_bundle), tmp_path / "state", replace(FAST, policy=SelectionPolicy(latency_retries=0)))
    doc = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
    assert not doc["passed"]
    fp32 = next(c for c in doc["candidates"] if c["variant"] == "fp32")
    parity_reason = next(r for r in fp32["reasons"] if r.startswith(("parity", "reproduction")) and "on sample" in r)
    sample = int(re.search(r"on sample (\d+)", parity_reason).group(1))
    out = tmp_path / "fail.html"
    assert edge_agent("report", str(tmp_path / "state" / "selftest" / "report.json"), "--out", str(out)).returncode == 0
    dom = _browser(out, tmp_path / "fail.png", tmp_path)
    el = _parse(dom)
    assert el.ids[f"sample-{sample}"]["class"] == "card fail"
    card = dom[dom.index(f'id="sample-{sample}"'):]
    card = card[:card.index("</div></div>") if "</div></div>" in card else 4000]
    assert "stage blamed: model" in card
    for c in doc["candidates"]:
        for r in c["reasons"]:  # every reason of every candidate is on the page
            assert r.replace("'", "&#x27;").replace("<", "&lt;") in dom or r in dom
    assert "budget 0.001 ms" in dom  # the budget line on the latency plot
    assert "FAIL" in dom and "latency-plot" in el.ids


def test_report_renders_new_per_sample_sections_with_their_bounds_without_code_changes(passing: tuple) -> None:
    """The self-test's schema grows (reproduction, fidelity): any per-sample metric with a bound is plotted,
    a sample out of bounds is highlighted with the stage its entry names."""
    doc = copy.deepcopy(passing[2])
    c = doc["candidates"][0]
    c["reproduction"] = {"bounds": {"max_abs": {"max": 0.01}},
                         "samples": [{"sample": i, "max_abs": 0.5 if i == 5 else 0.001, "stage": "model"} for i in range(8)]}
    c["fidelity"] = {"top1_agreement": {"value": 0.75, "min": 0.9}, "per_sample": [
        {"index": i, "cosine": {"value": 0.99 if i != 2 else 0.5, "bound": 0.95, "op": ">="}} for i in range(8)]}
    metrics = candidate_metrics(c)
    bad = {(m.section, m.name, m.sample) for m in metrics if m.passed is False}
    assert bad == {("reproduction", "max_abs", 5), ("fidelity", "top1_agreement", None), ("fidelity", "cosine", 2)}
    views = sample_views(c, metrics)
    assert views[5].failed and views[5].stages == {"model"} and views[2].failed and not views[3].failed
    page = render_report(doc)
    assert page.count("class='plot sample-plot'") == 2  # one plot per per-sample metric
    assert "id='sample-5'" in page and "card fail' id='sample-5'" in page and "card fail' id='sample-2'" in page
    assert "top1_agreement" in page and "&gt;= 0.9" in page


def test_update_report_shows_old_and_new_side_by_side(passing: tuple, tiny_bundle: Path, tmp_path: Path) -> None:
    _, old_state, old = passing  # v1
    rewrite_manifest(tiny_bundle, lambda d: d.update(version=2))
    _selftest(tiny_bundle, tmp_path / "new")
    out = tmp_path / "cmp.html"
    assert edge_agent("report", str(tmp_path / "new"), "--compare", str(old_state), "--out", str(out)).returncode == 0
    page = out.read_text()
    assert "Update: before and after" in page and "<h2>Before</h2>" in page and "<h2>After</h2>" in page
    assert f"{old['bundle']['name']} v1" in page and f"{old['bundle']['name']} v2" in page
    assert "p95 change" in page and page.count("CPU:int8") >= 3  # per candidate: before, after, and in each report


def test_report_of_32_samples_is_small_enough_to_attach_to_a_ticket(tmp_path: Path) -> None:
    """32 golden camera frames (160x160), two candidates, per-sample sections: under 2 MB."""
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_classifier, structured_frames

    from tests.conftest import TINY_SPEC

    spec = copy.deepcopy(TINY_SPEC)
    spec["frame"].update(height=160, width=160)
    d = tmp_path / "inputs"
    d.mkdir()
    np.savez_compressed(d / "calib.npz", raw=structured_frames(16, 160, 1))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(32, 160, 2))
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    bundle = create_bundle(CreateOptions(model=make_tiny_classifier(d / "m.onnx"), spec=d / "spec.yaml",
                                         calibration=d / "calib.npz", golden=d / "golden.npz", out=tmp_path / "b",
                                         min_agreement=0.0, keep_low_quality=True))
    doc = _selftest(bundle, tmp_path / "state")
    rng = np.random.default_rng(0)
    for c in doc["candidates"]:
        for section in ("reproduction", "fidelity"):
            c[section] = {"bounds": {"max_abs": {"max": 0.01}, "cosine": {"min": 0.99}},
                          "samples": [{"sample": i, "max_abs": float(rng.uniform(0, 0.012)),
                                       "cosine": float(rng.uniform(0.985, 1)), "stage": "model"} for i in range(32)]}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    out = tmp_path / "32.html"
    run = edge_agent("report", str(tmp_path / "r.json"), "--out", str(out), "--open")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == out.resolve().as_uri()  # --open prints where it is
    size = out.stat().st_size
    print(f"32-sample report: {size:,} bytes")
    assert out.read_text().count("<img ") == 32
    assert size < 2 * 2**20


def test_report_reads_the_devices_retained_selftest_from_the_broker(passing: tuple, tmp_path: Path) -> None:
    import paho.mqtt.client as paho

    from brokers import Broker

    tiny_bundle, _, doc = passing
    broker = Broker(tmp_path / "broker").start()
    try:
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        c.publish("edge/cam-7/selftest", json.dumps(doc), qos=1, retain=True).wait_for_publish(10)
        c.disconnect()  # before loop_stop: no 1 s wait for paho's select
        c.loop_stop()
        out = tmp_path / "remote.html"
        assert edge_agent("report", "--broker", f"127.0.0.1:{broker.port}", "--device", "cam-7", "--out", str(out),
                     "--bundle", str(tiny_bundle)).returncode == 0
        assert "tiny-classifier" in out.read_text() and out.read_text().count("<img ") == 8
        assert edge_agent("report", "--broker", f"127.0.0.1:{broker.port}", "--device", "nobody", "--wait", "1",
                     "--out", str(tmp_path / "none.html")).returncode == 1
    finally:
        broker.stop()


def test_health_carries_the_same_selftest_figures_the_page_shows(passing: tuple) -> None:
    doc = passing[2]
    health = build_health(device_id="d", uptime_s=1, session=1, interval_s=10, serving=True, not_serving_reason=None,
                          engine=None, placement=None, selftest=doc, pipeline=None, source=None, outbox=None,
                          process={})
    fig = selftest_figures(doc)
    assert health["selftest"]["passed"] == fig["passed"] and health["selftest"]["created_ts"] == fig["created_ts"]
    page = render_report(doc)
    for hc, c in zip(health["selftest"]["candidates"], doc["candidates"]):
        assert hc["p95_ms"] == c["latency"]["p95_ms"]  # from the report, not re-measured
        assert f"{hc['p95_ms']:.3g} ms" in page


def test_report_reads_findings_and_the_two_questions_blocks_of_the_self_test(passing: tuple) -> None:
    """The self-test's findings ({check, metric, value, bound, sample, stage}) and the reproduction and
    fidelity blocks (metrics with min_/max_ bounds, a tolerance with its bound): each on the page, the
    failing sample highlighted, the legacy parity summary no longer judged against the manifest."""
    doc = copy.deepcopy(passing[2])
    c = doc["candidates"][0]
    text = ("reproduction: max |a-b| beyond atol + rtol*|b| = 0.5978 over bound 0.001646 on sample 4 at stage model")
    c["reasons"] = [text]
    c["passed"] = False
    c["findings"] = [{"check": "reproduction", "metric": "max |a-b| beyond atol + rtol*|b|", "value": 0.5978,
                      "bound": 0.001646, "sample": 4, "stage": "model", "detail": "", "text": text}]
    c["reproduction"] = {"passed": False, "metrics": {"top1_agreement": 0.875}, "bounds": {"min_agreement": 0.99},
                         "tolerance": {"passed": False, "sample": 4, "abs_diff": 0.5978, "bound": 0.001646}}
    c["fidelity"] = {"passed": True, "metrics": {"top1_agreement": 1.0}, "bounds": {"min_top1_agreement": 0.98}}
    c["parity"] = {"min_cosine": 0.5}  # a flat view: not judged
    metrics = candidate_metrics(c)
    judged = {(m.section, m.name, m.sample, m.passed) for m in metrics if m.bound is not None}
    assert ("reproduction", "max |a-b| beyond atol + rtol*|b|", 4, False) in judged
    assert ("reproduction", "tolerance", 4, False) in judged
    assert ("fidelity.metrics", "top1_agreement", None, True) in judged
    page = render_report(doc)
    assert "card fail' id='sample-4'" in page and "stage blamed: model" in page
    judged_table = page.split("Metrics against their bounds")[1].split("more figures without a bound")[0]
    label = f"{c['provider'].replace('ExecutionProvider', '')}:{c['variant']}"
    assert f"<td>{label}</td><td>parity</td><td>min_cosine</td>" not in judged_table


@pytest.mark.slow  # a seeded fuzz: 20 mutated reports, each page with its plots (~100 s on a loaded machine)
def test_report_renders_damaged_and_unexpected_reports_without_crashing(passing: tuple) -> None:
    """Reports from other agent versions, cut-off JSON sections, wrong types: the page still renders,
    shows what it can, and never raises (seeded mutations of a real report)."""
    import random

    tiny_bundle, _, base = passing
    rng = random.Random(7)
    junk = [None, "text", 3, -1.5, float("nan"), [], {}, [1, "a"], {"x": {"value": "y"}}, True]

    def paths(d, prefix=()):
        if isinstance(d, dict):
            for k, v in d.items():
                yield prefix + (k,)
                yield from paths(v, prefix + (k,))
        elif isinstance(d, list):
            for i, v in enumerate(d):
                yield prefix + (i,)
                yield from paths(v, prefix + (i,))

    all_paths = list(paths(base))
    for _ in range(20):
        doc = copy.deepcopy(base)
        for p in rng.sample(all_paths, 5):
            try:
                parent = doc
                for k in p[:-1]:
                    parent = parent[k]
                if rng.random() < 0.4 and isinstance(parent, dict):
                    parent.pop(p[-1], None)
                else:
                    parent[p[-1]] = rng.choice(junk)
            except (KeyError, IndexError, TypeError):
                continue
        try:
            page = render_report(doc, bundle_root=tiny_bundle)
        except Exception as exc:  # noqa: BLE001 - the test names the mutation that broke it
            raise AssertionError(f"render failed on a mutated report: {type(exc).__name__}: {exc}") from exc
        assert page.startswith("<!DOCTYPE html>")
    render_report({"candidates": []})  # the least a report can be


def test_sensor_bundle_report_shows_each_golden_window_as_a_sparkline(tiny_sensor_bundle: Path, tmp_path: Path) -> None:
    doc = _selftest(tiny_sensor_bundle, tmp_path / "state")
    page = render_report(doc, bundle_root=tiny_sensor_bundle)
    assert page.count("src='data:image/svg+xml;base64,") == 6  # one per golden window, no JPEG of noise
    assert "id='latency-plot'" in page


def test_report_command_line_mistakes_exit_2_naming_the_flag(tiny_bundle: Path, tmp_path: Path) -> None:
    """Found in review: no source exited 1, a bad --broker port was an internal error, and a --bundle that
    does not exist was silently ignored (a page without thumbnails and bounds)."""
    nothing = edge_agent("report")
    assert nothing.returncode == 2 and "give a report.json" in nothing.stderr
    port = edge_agent("report", "--broker", "127.0.0.1:abc", "--device", "d1")
    assert port.returncode == 2 and "--broker" in port.stderr and "internal error" not in port.stderr
    missing = edge_agent("report", str(tmp_path), "--bundle", str(tmp_path / "missing"))
    assert missing.returncode == 2 and "--bundle" in missing.stderr and "not a bundle directory" in missing.stderr


def test_a_report_of_a_candidate_serving_degraded_opens_on_degraded_not_pass(passing: tuple, tmp_path: Path) -> None:
    """Fault: the page opened on a green PASS banner above the candidates' red FAIL rows while it served degraded;
    and the banner's self-test time read `8.924e+04 ms`."""
    _, _, doc = passing
    slow = copy.deepcopy(doc)
    slow.update(degraded="serving CPUExecutionProvider:fp32 degraded: p95 over budget", too_slow=True,
                duration_ms=89240.0)
    page = render_report(slow)
    assert 'class="banner degraded"' in page and ">DEGRADED<" in page
    assert 'class="banner pass"' not in page and ">PASS<" not in page.split("<h2>")[0]
    assert "1 min 29 s" in page and "e+04" not in page
    report = tmp_path / "report.json"
    report.write_text(json.dumps(slow))
    out = edge_agent("report", str(report), "--out", str(tmp_path / "slow.html"))
    assert out.returncode == 0 and out.stdout.startswith("DEGRADED: wrote"), out.stdout


def test_readable_durations() -> None:
    from agent.report.page import readable_duration

    assert [readable_duration(v) for v in (532.4, 8924.0, 89240.0, None)] == ["532 ms", "8.9 s", "1 min 29 s", "-"]


def test_the_first_report_does_not_print_matplotlibs_font_cache_notice() -> None:
    """Matplotlib warns "building the font cache; this may take a moment" when its first import takes over 5 s (a
    busy machine's first `edge-agent report`): noise on the report's stderr with nothing to do about it."""
    import logging

    from agent.report.plots import _pyplot

    _pyplot()
    assert logging.getLogger("matplotlib.font_manager").getEffectiveLevel() >= logging.ERROR
