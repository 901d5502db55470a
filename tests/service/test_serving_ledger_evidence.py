"""Charge only with evidence: a serving process killed from outside (SIGKILL: an operator, the OOM killer, a stop
time-out) during its candidate's first 64 inferences was charged as the candidate's crash for 7 days, and ten
such kills left the device dark for a week. Now a death is charged at once only when the process raised a fatal
signal of its own (faulthandler's dump in its fault file); one with no such dump is noted, retried, and charged
only when it recurs at the same inference in `UNEXPLAINED_DEATHS` processes in a row. Faults are real signals
(`EDGE_AGENT_FAULT`); the agent is a real `edge-agent run` process."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from agent.fsio import write_json_atomic
from agent.proof.isolation import CrashLedger
from agent.service import serving_ledger
from agentproc import demo_config, int8_first

INT8 = "CPUExecutionProvider:int8"


def _crashes(tmp_path: Path) -> list[tuple[str, str]]:
    f = tmp_path / "state" / "selftest" / "crashes.json"
    return [(r["step"], r["signal"]) for r in json.loads(f.read_text())] if f.exists() else []


def _dead_process(d: Path, token: str, inference: int, dump: str = "") -> None:
    """What a serving process killed at `inference` of its first 64 leaves: its marker, its in-flight record
    naming its thread and the inference, and its fault file (empty unless faulthandler dumped a fatal signal)."""
    marker = d / f"serving-1-{token}-1.json"
    write_json_atomic(marker, {"bundle": "sha", "candidate": INT8, "step": f"candidate:{INT8}", "process": token,
                               "phase": "first 64 inferences", "late": False, "boot_id": serving_ledger.boot_id()})
    marker.with_suffix(".inflight").write_bytes(f"1 7f00 #{inference}".encode())
    (d / f"serving-1-{token}.fault").write_text(dump)


def test_a_kill_with_no_fatal_signal_is_noted_not_charged_and_the_same_death_thrice_is(tmp_path: Path) -> None:
    d = tmp_path / "selftest"
    d.mkdir()
    for n, token in ((3, "aaaaaaaaaaaa"), (9, "bbbbbbbbbbbb"), (20, "cccccccccccc")):  # kills at random points
        _dead_process(d, token, n)
        assert serving_ledger.recover(d, CrashLedger(d)) == []
    assert not (d / "crashes.json").exists()
    assert serving_ledger.noted_deaths(d, "sha") == [
        f"candidate:{INT8}: killed with no fatal signal at inference 20, 1 of 3 in a row (not charged)"]
    for i, token in enumerate(("dddddddddddd", "eeeeeeeeeeee", "ffffffffffff")):  # a kill at the same inference
        _dead_process(d, token, 20)
        assert serving_ledger.recover(d, CrashLedger(d)) == ([f"candidate:{INT8}"] if i == 1 else [])


def test_a_fatal_signal_dumped_by_the_process_is_charged_after_one_death(tmp_path: Path) -> None:
    d = tmp_path / "selftest"
    d.mkdir()
    _dead_process(d, "aaaaaaaaaaaa", 3, "Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f00 "
                                        "(most recent call first):\n")
    assert serving_ledger.recover(d, CrashLedger(d)) == [f"candidate:{INT8}"]


@pytest.mark.slow  # four boots in a row
def test_sigkill_in_the_first_64_inferences_on_three_boots_charges_nothing_and_each_boot_serves(
        tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path))
    for boot, n in enumerate((4, 11, 23), 1):  # an operator's kill -9 lands at another inference each time
        agent = agent_process(cfg, name=f"boot{boot}", env={"EDGE_AGENT_FAULT": f"serve:{INT8}#{n}=SIGKILL"})
        assert agent.run(180) == -signal.SIGKILL, agent.log_text()[-2000:]
        # the boot served the candidate (not skipped as charged): the fault fires only in its serving session, and
        # the next boot reads the death from the candidate's own marker. Neither its results nor `boot.ready` are
        # evidence: a kill at the 4th inference can land before either is written (inference runs ahead of
        # publishing, and the pipeline starts before the boot logs `boot.ready`; CI at -n 2 saw both missing)
        if boot > 1:
            noted = [(e["step"], e["deaths"]) for e in agent.events("serving.unexplained_death")]
            assert noted == [(f"candidate:{INT8}", 1)], f"boot {boot - 1} did not die serving the candidate: {noted}"
        assert {e["variant"] for e in agent.events("boot.ready")} <= {"int8"}
        assert {r["variant"] for r in agent.results()} <= {"int8"}
        assert _crashes(tmp_path) == []
    agent = agent_process(cfg, name="boot4").start()
    assert agent.wait_results(1)[0]["variant"] == "int8"
    noted = agent.events("serving.unexplained_death")
    assert [(e["step"], e["deaths"]) for e in noted] == [(f"candidate:{INT8}", 1)]
    said = agent.events("boot.unexplained_deaths")  # health carries the same list (selftest.unexplained_deaths)
    assert said and "inference 23, 1 of 3 in a row (not charged)" in said[0]["deaths"][0]
    assert agent.stop(60) == 0
    assert _crashes(tmp_path) == []


@pytest.mark.slow
def test_a_native_crash_at_the_same_point_is_still_charged_after_one_boot(tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path))
    agent = agent_process(cfg, name="boot1", env={"EDGE_AGENT_FAULT": f"serve:{INT8}#4=SIGSEGV"})
    assert agent.run(180) == -signal.SIGSEGV, agent.log_text()[-2000:]
    agent = agent_process(cfg, name="boot2").start()
    assert agent.wait_results(1)[0]["variant"] == "fp32"
    assert agent.stop(60) == 0
    assert _crashes(tmp_path) == [(f"candidate:{INT8}", "the serving process died")]


def test_health_says_what_was_seen_and_not_charged() -> None:
    from agent.link.health import selftest_figures

    seen = f"candidate:{INT8}: killed with no fatal signal at inference 4, 1 of 3 in a row (not charged)"
    assert selftest_figures({"passed": True, "unexplained_deaths": [seen]})["unexplained_deaths"] == [seen]
