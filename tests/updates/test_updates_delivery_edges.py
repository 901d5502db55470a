"""Every delivery path survives every input, against a running agent and a real broker.

Faults (issue 20): a dangling symlink in the inbox killed the watcher for good (a valid bundle dropped
next was never picked up); a FIFO blocked every update, rollback, self-test and reload inside `open()`;
a server trickling headers held a download for 150 s against `download_deadline_s: 15`, and `rollback`
answered busy meanwhile; an update was proven under the config file as it was on disk (or defaults for a
config built in code), not under the config object that serves."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from agentproc import AgentProcess, demo_config
from brokers import MOSQUITTO, Broker, Collector
from slow_servers import header_trickle
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "dev-de"
PREFIX = f"edge/{DEVICE}/"
DEADLINE_S = 4.0

needs_broker = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                  reason="mosquitto is not installed (scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("delivery-edges")
    from agent.bundle.archive import pack
    from agent.bundle.signing import keygen, sign_bundle
    from agent.testing import rewrite_manifest

    keygen(tmp / "k.pem", tmp / "k.pub")
    newer = tmp / "newer"
    shutil.copytree(ROOT / "models" / "digits-classifier", newer)
    rewrite_manifest(newer, lambda m: m.update(version=m["version"] + 1))
    sign_bundle(newer, tmp / "k.pem")
    archive = pack(newer, tmp / "newer.tar.gz")
    broker = Broker(tmp / "broker").start()
    inbox = tmp / "inbox"
    cfg = demo_config(tmp, port=broker.port, device_id=DEVICE, source={"max_fps": 30}, output={"stdout": False},
                      updates={"enabled": True, "trusted_keys": [str(tmp / "k.pub")], "inbox": str(inbox),
                               "download_timeout_s": 2.0, "download_deadline_s": DEADLINE_S, "min_free_bytes": 0,
                               "probation_s": 1.0, "probation_frames": 10})
    proc = AgentProcess(tmp, cfg).start()  # one agent for the module (the fixture factory is per test)
    col = Collector(broker.port, [PREFIX + "#"])
    try:
        assert col.wait(lambda: len(col.on(PREFIX + "predictions")) >= 3, 120), proc.log_text()[-3000:]
        yield {"proc": proc, "col": col, "broker": broker, "tmp": tmp, "inbox": inbox, "archive": archive}
    finally:
        proc.stop()
        col.close()
        broker.stop()


def statuses(col: Collector, uid: str) -> list[dict]:
    return [d for d in (json.loads(m.payload) for m in col.on(PREFIX + "update/status")) if d["update"] == uid]


def replies(col: Collector, name: str) -> list[dict]:
    return [json.loads(m.payload) for m in col.on(PREFIX + f"cmd/{name}/reply")]


@needs_broker
def test_header_slow_loris_is_refused_within_the_deadline(agent: dict) -> None:
    web = header_trickle()
    col = agent["col"]
    try:
        n = len(replies(col, "update"))
        t0 = time.monotonic()
        col.c.publish(PREFIX + "cmd/update", json.dumps({"url": f"http://127.0.0.1:{web.port}/b.tar.gz",
                                                         "sha256": "0" * 64, "id": "loris"}), qos=1)
        assert col.wait(lambda: len(replies(col, "update")) > n, 60), "no reply to the update"
        took = time.monotonic() - t0
        r = replies(col, "update")[-1]
        assert r["ok"] is False and f"download_deadline_s {DEADLINE_S:g}" in r["update"]["reason"], r
        print(f"header slow-loris refused after {took:.2f} s (deadline {DEADLINE_S:g} s)")
        assert took < DEADLINE_S + 2, took
    finally:
        web.close()


@needs_broker
def test_rollback_answers_while_a_download_is_in_flight(agent: dict) -> None:
    web = header_trickle()
    col = agent["col"]
    try:
        nu, nr = len(replies(col, "update")), len(replies(col, "rollback"))
        col.c.publish(PREFIX + "cmd/update", json.dumps({"url": f"http://127.0.0.1:{web.port}/b.tar.gz",
                                                         "sha256": "0" * 64, "id": "inflight"}), qos=1)
        assert col.wait(lambda: any(s["step"] == "downloading" for s in statuses(col, "inflight")), 30)
        t0 = time.monotonic()
        col.c.publish(PREFIX + "cmd/rollback", b'{"id": "rb"}', qos=1)
        assert col.wait(lambda: len(replies(col, "rollback")) > nr, 30)
        took = time.monotonic() - t0
        rb = replies(col, "rollback")[-1]
        # not "busy": the machine took the rollback and cancelled the download (the demo store holds no
        # earlier committed bundle, so the rollback itself is refused for that reason, and says so)
        assert not rb.get("busy") and "no previous committed bundle" in rb["update"]["reason"], rb
        assert col.wait(lambda: len(replies(col, "update")) > nu, 30)
        up = replies(col, "update")[-1]
        assert "cancelled" in up["update"]["reason"], up
        print(f"rollback answered after {took:.2f} s with a download in flight; the download: {up['update']['reason']}")
    finally:
        web.close()


@needs_broker
def test_dangling_symlink_fifo_and_directory_in_the_inbox_are_rejected_and_a_valid_bundle_commits(agent: dict) -> None:
    inbox, col = agent["inbox"], agent["col"]
    assert wait_until(lambda: (inbox / "rejected").is_dir(), 60)
    (inbox / "dangling.tar.gz").symlink_to(inbox / "nowhere.tar.gz")
    os.mkfifo(inbox / "fifo.tar.gz")
    (inbox / "dir.tar.gz").mkdir()
    (inbox / "dir.tar.gz" / "x").write_text("x")
    for name in ("dangling.tar.gz", "fifo.tar.gz", "dir.tar.gz"):
        assert col.wait(lambda: any(s["state"] == "rejected" for s in statuses(col, name)), 30), name
        reason = [s for s in statuses(col, name) if s["state"] == "rejected"][-1]["reason"]
        assert "not a regular file" in reason, (name, reason)
        assert wait_until(lambda: os.path.lexists(inbox / "rejected" / name), 10), name
        assert not os.path.lexists(inbox / name)
    t0 = time.monotonic()
    shutil.copy(agent["archive"], inbox / "good.tar.gz.part")
    os.replace(inbox / "good.tar.gz.part", inbox / "good.tar.gz")
    # seen once in a fast lane of 1,337 tests (thirteenth session), never alone: stuck after `switched`; the whole
    # status trail and the agent's log tail say where
    assert col.wait(lambda: any(s["state"] == "committed" for s in statuses(col, "good.tar.gz")), 180), \
        (statuses(col, "good.tar.gz"), agent["proc"].log_text()[-4000:])
    print(f"valid bundle after three hostile entries committed in {time.monotonic() - t0:.1f} s")
    assert wait_until(lambda: (inbox / "done" / "good.tar.gz").exists(), 30)
    assert agent["proc"].returncode is None
    errors = [line for line in agent["proc"].log_text().splitlines() if line and not line.startswith("{")]
    assert errors == [], errors[:5]  # every line is a JSON event: no bare traceback


def test_an_update_is_proven_under_the_serving_config_object(tmp_path: Path, tiny_bundle_master: Path) -> None:
    """A config built in code (no file): the pinned variant and the CPU-fallback ban reach the proof."""
    import dataclasses

    from agent.config import Config, ProvidersConfig, SelectionConfig
    from agent.updates.store import BundleStore
    from agent.updates.updater import Updater

    def prove(cfg: Config) -> dict:
        store = BundleStore(tmp_path / "store")
        up = Updater(None, store, cfg.updates, tmp_path / "state", lambda: cfg, lambda doc: None)  # type: ignore[arg-type]
        return up._child_selftest(tiny_bundle_master)

    base = Config(state_dir=tmp_path / "state")
    default = prove(base)
    assert default["passed"] and default["selected"]["variant"] == "fp32"  # the bundle's preference
    pinned = prove(dataclasses.replace(base, selection=SelectionConfig(variant="int8")))
    assert pinned["passed"] and pinned["selected"]["variant"] == "int8", pinned["selected"]
    no_cpu = prove(dataclasses.replace(base, selection=SelectionConfig(allow_cpu_fallback=False),
                                       providers=ProvidersConfig(order=("CUDAExecutionProvider", "CPUExecutionProvider"))))
    assert not no_cpu["passed"] and "selection.allow_cpu_fallback" in json.dumps(no_cpu), no_cpu.get("reason")


FUZZED_IDS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" + b"0" * 400, b"-0.0", b"1e-400",
              b'"\\ud800"', b'"\\u0000"', b"[1e999]", b'{"a": NaN}', b"true", b"null", b'"' + b"x" * 5000 + b'"']


def _strict(payload: bytes) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in a reply")
    def finite(text: str) -> float:
        value = float(text)
        assert value == value and abs(value) != float("inf"), f"{text} in a reply"
        return value
    return json.loads(payload, parse_constant=refuse, parse_float=finite)


@needs_broker
def test_fuzzed_command_ids_get_strict_json_replies(agent: dict) -> None:
    col = agent["col"]
    n = len(replies(col, "status"))
    for raw in FUZZED_IDS:
        col.c.publish(PREFIX + "cmd/status", b'{"id": ' + raw + b"}", qos=1)
    assert col.wait(lambda: len(replies(col, "status")) >= n + len(FUZZED_IDS), 60)
    got = [m.payload for m in col.on(PREFIX + "cmd/status/reply")][n:]
    for payload in got:
        _strict(payload)  # raises on NaN, Infinity, -Infinity or a number out of a double's range
    print(f"{len(got)} replies to fuzzed ids, all strict JSON")
