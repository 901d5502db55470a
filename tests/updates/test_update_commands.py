"""The update commands: one parser and one "repeated" rule, which the agent's controller and the fleet
simulator both use (their copies differed: the simulator called any `update` naming the committed id a
repeat, whatever its sha256 and whatever the store served)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from agent.updates.commands import (CommandRefused, Rollback, UrlUpdate, is_repeat, parse_update_command,
                                    repeat_reply)
from agent.updates.machine import Snapshot, State

ROOT = Path(__file__).resolve().parents[2]
SHA = "a" * 64


def test_update_payloads_parse_to_values_or_the_error_the_reply_carries() -> None:
    assert parse_update_command("update", {"url": "https://h/x/v3.tar.gz", "sha256": SHA}) == \
        UrlUpdate("https://h/x/v3.tar.gz", SHA, "v3.tar.gz")  # the id defaults to the URL's file
    assert parse_update_command("update", {"url": "https://h/v3", "sha256": SHA, "id": 7}).id == "7"
    assert parse_update_command("update", {"url": "https://h/v", "sha256": SHA, "id": "x" * 500}).id == "x" * 100
    assert parse_update_command("rollback", {}) == Rollback("rollback")
    assert parse_update_command("rollback", {"id": "r1"}) == Rollback("r1")
    for bad in ({}, {"url": "https://h/v"}, {"sha256": SHA}, {"url": 3, "sha256": SHA}, {"url": "u", "sha256": None}):
        with pytest.raises(CommandRefused, match=r'update needs \{"url"'):
            parse_update_command("update", bad)
    with pytest.raises(CommandRefused, match="not an update command: 'pause'"):
        parse_update_command("pause", {})


COMMITTED = Snapshot(State.COMMITTED, "v3.tar.gz", "url", "tiny-v3-abc", 1.0, "ok")
CMD = UrlUpdate("https://h/v3.tar.gz", SHA, "v3.tar.gz")


@pytest.mark.parametrize(("why", "snap", "url_committed", "current", "committed", "repeat"), [
    ("the last URL update, sent again, still serving", COMMITTED, ("v3.tar.gz", SHA), "tiny-v3-abc", "tiny-v3-abc", True),
    ("another sha256 under the same id", COMMITTED, ("v3.tar.gz", "b" * 64), "tiny-v3-abc", "tiny-v3-abc", False),
    ("a restart forgot what this process committed", COMMITTED, None, "tiny-v3-abc", "tiny-v3-abc", False),
    ("committed by MQTT or the inbox, not by this URL", replace(COMMITTED, origin="mqtt"), None, "tiny-v3-abc",
     "tiny-v3-abc", False),
    ("the machine moved on (a rollback)", replace(COMMITTED, state=State.ROLLED_BACK), ("v3.tar.gz", SHA),
     "tiny-v3-abc", "tiny-v3-abc", False),
    ("another update holds the machine", replace(COMMITTED, update="v4"), ("v3.tar.gz", SHA), "tiny-v3-abc",
     "tiny-v3-abc", False),
    ("the store serves another bundle", COMMITTED, ("v3.tar.gz", SHA), "tiny-v2-def", "tiny-v2-def", False),
    ("the bundle is current but not committed", COMMITTED, ("v3.tar.gz", SHA), "tiny-v3-abc", "tiny-v2-def", False),
    ("no bundle recorded", replace(COMMITTED, bundle=None), ("v3.tar.gz", SHA), None, None, False),
])
def test_the_repeated_rule_both_the_agent_and_the_simulator_follow(why: str, snap: Snapshot,
                                                                  url_committed: tuple[str, str] | None,
                                                                  current: str | None, committed: str | None,
                                                                  repeat: bool) -> None:
    """Fault: the simulator answered `repeated` for any `update` naming the committed id (another sha256, a
    bundle no longer serving), where the agent installed it: a rehearsal differed from the fleet it models."""
    assert is_repeat(CMD, snap, url_committed, current, committed) is repeat, why


def test_a_repeat_is_answered_with_its_verdict() -> None:
    last = {"update": "v3.tar.gz", "state": "committed", "bundle": "tiny-v3-abc"}
    assert repeat_reply(CMD, last) == {"ok": True, "repeated": True, "update": last}
    assert repeat_reply(CMD, {"update": "other", "state": "committed"})["update"] == \
        {"update": "v3.tar.gz", "state": "committed"}
    assert repeat_reply(CMD, None)["update"] == {"update": "v3.tar.gz", "state": "committed"}


@pytest.mark.parametrize("module", ["agent/service/update_host.py", "agent/fleet/simulator.py"])
def test_the_agent_and_the_simulator_parse_with_the_shared_module(module: str) -> None:
    """Each calls the shared parser and rule, and spells no copy of its own (the id's default, the payload check)."""
    tree = ast.parse((ROOT / module).read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"parse_update_command", "is_repeat", "repeat_reply"} <= called
    text = (ROOT / module).read_text()
    assert 'rsplit("/", 1)' not in text and 'update needs {\\"url\\"' not in text
