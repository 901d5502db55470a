"""The report page shows the proof while serving (issue 19): the audit's counters, its last canary and
live window, the evidence of a drift, the re-proof schedule and its next attempt, and the loud states,
from the device's health message (a saved one, a `status` reply, or the retained topic on a broker).

The health documents are made by the real producers (`Auditor.to_dict`, `Reproof.to_dict`), so the
page follows what the agent publishes, not a copy of its shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.bundle.load import load_bundle
from agent.proof.selftest import SelftestOptions, run_selftest
from agent.report.page import SERVING_HINT, render_report
from agent.service.audit import Auditor, AuditSettings
from agent.service.reproof import Reproof, ReproofSchedule

ROOT = Path(__file__).resolve().parents[2]
INT8 = "CPUExecutionProvider:int8"


class _Texts(HTMLParser):
    """The text inside each element that has an id (nested ids each get their own text too)."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, str | None]] = []
        self.texts: dict[str, str] = {}
        self.classes: dict[str, list[str]] = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag in ("br", "img", "meta", "input"):
            return
        self.open.append((tag, a.get("id")))
        if a.get("id"):
            self.texts[a["id"]] = ""
        if tag == "tr":
            for _, i in self.open:
                if i:
                    self.classes.setdefault(i, []).append(a.get("class", ""))

    def handle_endtag(self, tag: str) -> None:
        while self.open:
            t, _ = self.open.pop()
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, i in self.open:
            if i:
                self.texts[i] += data + " "


def _texts(page: str) -> _Texts:
    p = _Texts()
    p.feed(page)
    return p


@pytest.fixture(scope="module")
def proven(tiny_bundle_master: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One real self-test report for the module (read only), and the state directory holding it."""
    state = tmp_path_factory.mktemp("serving-proof") / "state"
    run_selftest(load_bundle(tiny_bundle_master), state, SelftestOptions(latency_runs=20))
    return json.loads((state / "selftest" / "report.json").read_text()), state


def _drifted_audit() -> dict:
    """An auditor that ran canaries and live windows, then saw the canary drift."""
    a = Auditor(AuditSettings(canary_period_s=60.0, live_period_s=30.0), lambda: None, None)
    a.counters.update(canary_runs=12, canary_failures=1, live_samples=40, live_windows=5)
    t = time.time()
    a.last = {"canary": {"sample": 3, "passed": False, "at_unix": t},
              "live": {"frames": 8, "passed": True, "at_unix": t - 20, "metrics": {"top-1 agreement": 1.0}}}
    engine = SimpleNamespace(candidate=SimpleNamespace(key=INT8))
    a._engine = engine  # type: ignore[assignment]  # the engine it audits (attached while serving)
    a._found("canary", engine, {"sample": 3, "findings": [  # type: ignore[arg-type]
        "reproduction: max_abs = 0.81 over bound 0.05 at sample 3 <b>stage model</b>"]})
    return a.to_dict()


def _armed_reproof() -> dict:
    """Nothing serves: every candidate was too slow at boot and at the first re-proof; the next is due."""
    now = [1000.0]
    r = Reproof(ReproofSchedule(first_s=30.0, max_s=900.0), clock=lambda: now[0])
    too_slow = {"passed": False, "too_slow": True}
    r.after_proof(too_slow, serving=False, reason="p95 14.2 ms over budget 12 ms")
    now[0] += 30.0
    r.started()
    r.after_proof(too_slow, serving=False, reason="p95 13.1 ms over budget 12 ms")
    now[0] += 15.0  # this health message went out 15 s into the 60 s wait
    return r.to_dict()


def _health(doc: dict, *, serving: bool, audit: dict, reproof: dict, pinned: str | None = None) -> dict:
    from agent.link.health import health_selftest

    selftest = health_selftest({**doc, "pinned_below_floor": pinned})
    return {"ts": time.time(), "device_id": "cam-7", "serving": serving, "variant": "int8" if serving else None,
            "not_serving_reason": None if serving else "no candidate passed: too slow",
            "selftest": selftest, "audit": audit, "reproof": reproof}


def test_report_page_shows_the_audit_counters_last_checks_and_the_drift_evidence(proven: tuple[dict, Path]) -> None:
    doc = proven[0]
    health = _health(doc, serving=True, audit=_drifted_audit(), reproof=Reproof(ReproofSchedule()).to_dict(),
                     pinned="worst channel SNR dB 11.2 under 15")
    page = render_report(doc, health=health)
    t = _texts(page)
    assert "degraded" in t.texts["audit-state"] and INT8 in t.texts["audit-state"]
    counters = t.texts["audit-counters"].split()
    for key, value in (("canary_runs", "12"), ("canary_failures", "1"), ("live_samples", "40"),
                       ("live_windows", "5"), ("live_drift", "0")):
        assert counters[counters.index(key) + 1] == value, (key, t.texts["audit-counters"])
    # the counters that count trouble are red when non-zero: canary_failures is, live_drift is not
    rows = t.classes["audit-counters"][1:]  # after the header row
    assert rows == ["", "fail", "", "", "", ""], rows
    last = t.texts["audit-last"]
    assert "golden sample 3" in last and "8 frames" in last and "top-1 agreement 1" in last
    evidence = t.texts["audit-evidence"]
    assert "canary audit of " + INT8 in evidence and "max_abs = 0.81 over bound 0.05 at sample 3" in evidence
    assert "<b>stage model</b>" not in page and "&lt;b&gt;stage model&lt;/b&gt;" in page  # device data is text
    loud = t.texts["loud-states"]
    assert "PINNED BELOW FLOOR: worst channel SNR dB 11.2 under 15" in loud
    assert f"DEGRADED: the canary audit of {INT8} drifted" in loud
    assert "armed" in t.texts["reproof"] and "no" in t.texts["reproof"].split()  # serving: not armed
    assert SERVING_HINT not in page


def test_report_page_shows_the_reproof_schedule_and_its_next_attempt(proven: tuple[dict, Path]) -> None:
    doc = proven[0]
    reproof = _armed_reproof()
    assert reproof["armed"] and reproof["attempts"] == 1 and reproof["next_attempt_in_s"] == 45.0
    page = render_report(doc, health=_health(doc, serving=False, audit=Auditor(AuditSettings(), lambda: None,
                                                                               None).to_dict(), reproof=reproof))
    r = _texts(page).texts["reproof"]
    assert "p95 13.1 ms over budget 12 ms" in r
    assert "(45 s after this health message)" in r
    nxt = time.strftime("%Y-%m-%d %H:%M", time.gmtime(reproof["next_attempt_unix"]))
    assert nxt in r
    assert "30, 60, 120, 240, 480, 900" in r  # the backoff, doubling and capped
    assert "attempt 1 at " in r  # the re-proof that ran after the boot's refusal
    assert "NOT serving: no candidate passed: too slow" in page
    assert "idle" in _texts(page).texts["audit-state"]


def test_report_without_health_says_where_the_serving_proof_is(proven: tuple[dict, Path]) -> None:
    doc = proven[0]
    assert SERVING_HINT.split(":")[0] in render_report(doc).replace("&#39;", "'")


def edge_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow  # four `edge-agent report` processes and a broker
def test_report_command_reads_health_from_a_status_reply_and_from_the_broker(proven: tuple[dict, Path],
                                                                             tmp_path: Path) -> None:
    import paho.mqtt.client as paho

    from brokers import Broker

    doc, state = proven
    health = _health(doc, serving=True, audit=_drifted_audit(), reproof=_armed_reproof())
    reply = tmp_path / "status.json"
    reply.write_text(json.dumps({"ok": True, "health": health}))  # what `status` answers
    out = tmp_path / "page.html"
    done = edge_agent("report", str(state), "--health", str(reply), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "max_abs = 0.81 over bound 0.05" in _texts(out.read_text()).texts["audit-evidence"]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"candidates": []}))
    refused = edge_agent("report", str(state), "--health", str(bad), "--out", str(out))
    assert refused.returncode != 0 and "--health" in refused.stderr and "not a health message" in refused.stderr
    missing = edge_agent("report", str(state), "--health", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "--health" in missing.stderr

    broker = Broker(tmp_path / "broker").start()
    try:
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        c.publish("edge/cam-7/selftest", json.dumps(doc), qos=1, retain=True).wait_for_publish(10)
        c.publish("edge/cam-7/health", json.dumps(health), qos=1, retain=True).wait_for_publish(10)
        c.disconnect()  # before loop_stop: no 1 s wait for paho's select
        c.loop_stop()
        remote = tmp_path / "remote.html"
        done = edge_agent("report", "--broker", f"127.0.0.1:{broker.port}", "--device", "cam-7", "--out", str(remote))
        assert done.returncode == 0, done.stderr
        t = _texts(remote.read_text())
        assert "canary_failures 1" in " ".join(t.texts["audit-counters"].split())
        assert "(45 s after this health message)" in t.texts["reproof"]
    finally:
        broker.stop()
