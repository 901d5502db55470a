"""Review of issue 43 ("a device that can serve always serves"): a damaged evidence or marker file in
<state_dir>/selftest must not keep a device dark. A truncated file reads as absent (read_json); a file that
is valid JSON of the wrong type (a list where an object is expected: disk corruption, a hand edit, a tool of
another version) is a different path. Each case boots the demo agent once on a state dir holding one such
file and asks for a result.

Every case boots and serves: a file of the wrong type is read as absent and said (`state.file_ignored`);
before, four of them kept the device dark (AttributeError in take_marker, selftest_child, note_served)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentproc import demo_config

HOLDS = [
    ("crashes.json", "[1]"),
    ("crashes.json", '{"step": "candidate:CPUExecutionProvider:fp32"}'),
    ("disproven.json", '[1, "x", {"bundle": 1}]'),
    ("late-deaths.json", "[1]"),
    ("inflight.json", '{"bun'),       # torn: reads as absent
    ("crashed.json", "[1]"),          # the skip list: rewritten by the parent before the child reads it
]

FAULTS = [
    # isolation.CrashLedger.take_marker: `inflight.get(...)` on a list -> AttributeError at the start of every
    # proof; the file is unlinked only after the read, so every restart dies the same way
    ("inflight.json", "[1]"),
    ("step.json", '"load"'),
    # selftest_child: `cached.get(...)` on a list -> the child exits 1 with no report; boot.not_serving
    ("cache.json", "[1]"),
    # boot.note_served: `last.get(...)` on a list -> raises after the engine opened
    ("served.json", "[1]"),
]


def _boot_serves(tmp_path: Path, agent_process, name: str, content: str) -> tuple[bool, str]:
    cfg = demo_config(tmp_path)
    d = tmp_path / "state" / "selftest"
    d.mkdir(parents=True)
    (d / name).write_text(content)
    agent = agent_process(cfg, name="boot").start()
    try:
        agent.wait(lambda: agent.results() or agent.returncode is not None or agent.events("boot.not_serving"),
                   timeout=150, what="a result, an exit or boot.not_serving")
    except AssertionError:
        pass
    served = bool(agent.results())
    said = [l for l in agent.log_text().splitlines() if "not_serving" in l or "Error" in l or "rror:" in l]
    tail = f"exit {agent.returncode}; " + " | ".join(said)[-1500:]
    if agent.returncode is None:
        agent.stop(60)
    return served, tail


@pytest.mark.slow
@pytest.mark.parametrize("name,content", HOLDS)
def test_a_damaged_state_file_that_is_ignored(tmp_path: Path, agent_process, name: str, content: str) -> None:
    served, tail = _boot_serves(tmp_path, agent_process, name, content)
    assert served, tail


@pytest.mark.slow
@pytest.mark.parametrize("name,content", FAULTS)
def test_a_wrong_type_state_file_does_not_keep_the_device_dark(tmp_path: Path, agent_process, name: str,
                                                                content: str) -> None:
    served, tail = _boot_serves(tmp_path, agent_process, name, content)
    assert served, tail
