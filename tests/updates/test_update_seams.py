"""Faults found at the seams between the controller (issue 13), the outer surface (issue 12) and the
report/metrics (issue 14), each pinned by a test named after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent.hashing import sha256_file
from agent.report.sources import load_report


def _report(version: int, sha: str, path: Path, created: str, p95: float) -> dict:
    return {"schema": 1, "created": created, "passed": True, "reason": None,
            "bundle": {"name": "tiny-classifier", "version": version, "manifest_sha256": sha, "path": str(path)},
            "selected": {"provider": "CPUExecutionProvider", "variant": "fp32", "precision": "fp32"},
            "candidates": [{"provider": "CPUExecutionProvider", "variant": "fp32", "verdict": "pass",
                            "latency": {"p95_ms": p95}}]}


def test_report_from_a_state_dir_after_an_update_shows_the_serving_bundles_selftest_not_the_boots(
        tmp_path: Path, tiny_bundle_master: Path) -> None:
    """An update's proof runs in <state>/update-selftest (the controller), and the served self-test doc
    (health, /metrics, the retained topic) becomes that report; `edge-agent report <state>` read only
    <state>/selftest/report.json, the boot's report of the bundle the update replaced."""
    state = tmp_path / "state"
    v1, v2 = state / "store" / "bundles" / "v1", state / "store" / "bundles" / "v2"
    shutil.copytree(tiny_bundle_master, v1)
    shutil.copytree(tiny_bundle_master, v2)
    with open(v2 / "bundle.yaml", "a") as f:
        f.write("# v2\n")
    (state / "store" / "current").symlink_to("bundles/v2")
    boot = _report(1, sha256_file(v1 / "bundle.yaml"), v1, "2026-01-01T00:00:00+00:00", 1.0)
    upd = _report(2, sha256_file(v2 / "bundle.yaml"), state / "store" / "staging" / "update-x" / "bundle",
                  "2026-01-01T00:01:00+00:00", 2.0)
    for p, doc in ((state / "selftest" / "report.json", boot),
                   (state / "update-selftest" / "selftest" / "report.json", upd)):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc))

    got = load_report(state)
    assert got["bundle"]["version"] == 2 and got["created"] == upd["created"]
    # the staging path the update was proven in is gone: the page finds the bundle where it now lives
    assert Path(got["bundle"]["path"]).resolve() == v2.resolve()

    # after a rollback to v1, re-proven in update-selftest: the newer v1 report is the one that serves
    (state / "store" / "current").unlink()
    (state / "store" / "current").symlink_to("bundles/v1")
    rb = _report(1, sha256_file(v1 / "bundle.yaml"), v1, "2026-01-01T00:02:00+00:00", 3.0)
    (state / "update-selftest" / "selftest" / "report.json").write_text(json.dumps(rb))
    assert load_report(state)["created"] == rb["created"]

    # no store (updates off): the boot's report, as before
    shutil.rmtree(state / "store")
    assert load_report(state)["created"] == boot["created"]


# -- a real agent, a real broker --------------------------------------------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from agentproc import AgentProcess, demo_config  # noqa: E402
from brokers import Broker, Collector  # noqa: E402
from update_kits import key_and_frames  # noqa: E402
from waiting import end_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "dev-seams"
PREFIX = f"edge/{DEVICE}/"


@pytest.fixture(scope="module")
def seam_kit(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_master: Path) -> dict:
    from agent.bundle.archive import pack
    from agent.bundle.signing import sign_bundle
    from agent.testing import rewrite_manifest

    d = tmp_path_factory.mktemp("seam-kit")
    frames = key_and_frames(d)
    shutil.copytree(tiny_bundle_master, d / "v1")  # the operator's seed, unsigned
    shutil.copytree(tiny_bundle_master, d / "v2")
    rewrite_manifest(d / "v2", lambda m: m.update(version=2))
    sign_bundle(d / "v2", d / "k.pem")
    return {"dir": d, "frames": frames, "pub": d / "k.pub", "v1": d / "v1", "v2": pack(d / "v2", d / "v2.tar.gz")}


def _agent(agent_process, tmp: Path, kit: dict, port: int, **updates) -> AgentProcess:
    return agent_process(demo_config(
        tmp, port=port, device_id=DEVICE, bundle=str(kit["v1"]), source={"path": str(kit["frames"]), "max_fps": 30},
        output={"stdout": False},
        updates={"enabled": True, "trusted_keys": [str(kit["pub"])], "max_bundle_bytes": 2 * 2**20, **updates})).start()


PUSH_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _push_v2(seam_kit: dict, port: int) -> list[str]:
    """`edge-agent push` of the kit's v2 bundle to the test device (prints each status, then exits)."""
    return [sys.executable, "-m", "agent", "push", "--device", DEVICE, "--bundle", str(seam_kit["v2"]),
            "--broker", f"127.0.0.1:{port}", "--timeout", "90"]


def _push_to_the_end(seam_kit: dict, port: int) -> dict:
    """`edge-agent push` of v2, waited for: the last status it printed."""
    out = subprocess.run(_push_v2(seam_kit, port), cwd=ROOT, capture_output=True, text=True, timeout=120, env=PUSH_ENV)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _statuses(col: Collector) -> list[dict]:
    return [json.loads(m.payload) for m in col.on(PREFIX + "update/status")]


@pytest.fixture
def rig(tmp_path: Path):
    """A broker and a collector on the device's topics; pushers started into `pushers` are killed at the end."""
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    pushers: list[subprocess.Popen] = []
    yield broker, col, pushers
    for p in pushers:
        end_process(p, graceful=False)
    col.c.loop_stop()
    broker.stop()


def _push_into_probation(agent: AgentProcess, rig: tuple, seam_kit: dict) -> None:
    """Once the agent serves, push v2 in the background and wait until its probation begins."""
    broker, col, pushers = rig
    assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), agent.log_text()[-3000:]
    pushers.append(subprocess.Popen(_push_v2(seam_kit, broker.port), cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=PUSH_ENV))
    assert col.wait(lambda: any(s["state"] == "probation" for s in _statuses(col)), 90), agent.log_text()[-3000:]


def test_sigterm_during_probation_does_not_commit_a_bundle_probation_never_watched(
        tmp_path: Path, seam_kit: dict, agent_process, rig: tuple) -> None:
    """Probation stops watching when the agent stops; the judge then saw a few clean frames and the
    updater committed the bundle after 0.1 s and 2 frames of a 3 s / 30 frame probation."""
    broker, col, _ = rig
    agent = _agent(agent_process, tmp_path, seam_kit, broker.port, probation_s=60.0, probation_frames=100000)
    _push_into_probation(agent, rig, seam_kit)
    assert agent.stop() == 0
    # published before the agent exited; forwarded to this subscriber a moment later
    assert col.wait(lambda: _statuses(col)[-1]["state"] != "probation", 30), _statuses(col)[-1]
    final = _statuses(col)[-1]
    assert final["state"] == "rolled_back", final
    assert "shutdown" in final["reason"]
    store = tmp_path / "state" / "store"
    assert os.readlink(store / "committed") == os.readlink(store / "current")
    assert "-v1-" in os.readlink(store / "committed")


def test_update_while_paused_is_refused_as_paused_not_blamed_on_the_bundle(tmp_path: Path, seam_kit: dict,
                                                                            agent_process, rig: tuple) -> None:
    """`pause` stops frames; an update switched in then served nothing on probation and was rolled back as
    "zero results ... none served", blaming a good bundle for the operator's pause."""
    import paho.mqtt.publish as publish

    broker, col, _ = rig
    agent = _agent(agent_process, tmp_path, seam_kit, broker.port, probation_s=2.0, probation_frames=20)
    assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), agent.log_text()[-3000:]
    publish.single(PREFIX + "cmd/pause", b"{}", qos=1, hostname="127.0.0.1", port=broker.port)
    assert col.wait(lambda: col.on(PREFIX + "cmd/pause/reply"), 30)
    final = _push_to_the_end(seam_kit, broker.port)
    assert final["state"] != "committed", final
    assert "paused" in final["reason"] and "zero results" not in final["reason"], final
    assert agent.returncode is None
    store = tmp_path / "state" / "store"
    assert "-v1-" in os.readlink(store / "current") and "-v1-" in os.readlink(store / "committed")


def test_a_key_removed_from_trusted_keys_by_reload_no_longer_verifies_updates(tmp_path: Path, seam_kit: dict,
                                                                               agent_process, rig: tuple) -> None:
    """SIGHUP re-read the config but the updater kept the updates settings it started with: a signing key
    the operator removed from updates.trusted_keys (a revocation) still verified pushed bundles."""
    import signal

    from agent.bundle.signing import keygen

    keygen(tmp_path / "new.pem", tmp_path / "new.pub")
    broker, col, _ = rig
    agent = _agent(agent_process, tmp_path, seam_kit, broker.port, probation_s=1.0, probation_frames=10)
    assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), agent.log_text()[-3000:]
    agent.config["updates"] = {**agent.config["updates"], "trusted_keys": [str(tmp_path / "new.pub")]}
    agent.write_config()  # the old key is revoked
    agent.signal(signal.SIGHUP)
    agent.wait_event("reload.start", timeout=60)
    n = len(col.on(PREFIX + "health"))
    assert col.wait(lambda: len(col.on(PREFIX + "health")) > n + 2
                    and json.loads(col.on(PREFIX + "health")[-1].payload)["serving"], 60)
    final = _push_to_the_end(seam_kit, broker.port)
    assert final["state"] == "rejected", final
    assert "-v1-" in os.readlink(tmp_path / "state" / "store" / "committed")


@pytest.mark.parametrize("url", ["http://[::1", "https://[fe80::1%zz/x", "http://127.0.0.1:port/x"])
def test_a_malformed_url_is_refused_with_a_reason_not_a_traceback(url: str) -> None:
    """urlsplit's ValueError (an unclosed IPv6 bracket) escaped check_url: the update command logged a
    traceback, replied "ValueError: Invalid IPv6 URL" and published no update status."""
    from agent.updates.delivery import UrlRefused, check_url

    with pytest.raises(UrlRefused, match="malformed URL"):
        check_url(url, allow_http=False)


def test_pause_during_probation_is_busy_not_a_rollback_of_a_good_bundle(tmp_path: Path, seam_kit: dict,
                                                                        agent_process, rig: tuple) -> None:
    """A `pause` accepted while an update was on probation starved the judge: the good bundle was rolled
    back as "zero results". While an update or rollback runs, pause answers busy."""
    import paho.mqtt.publish as publish

    broker, col, _ = rig
    agent = _agent(agent_process, tmp_path, seam_kit, broker.port, probation_s=4.0, probation_frames=100000)
    _push_into_probation(agent, rig, seam_kit)
    publish.single(PREFIX + "cmd/pause", b"{}", qos=1, hostname="127.0.0.1", port=broker.port)
    assert col.wait(lambda: col.on(PREFIX + "cmd/pause/reply"), 30)
    reply = json.loads(col.on(PREFIX + "cmd/pause/reply")[-1].payload)
    assert reply["ok"] is False and reply.get("busy"), reply
    assert col.wait(lambda: _statuses(col)[-1]["state"] in ("committed", "rolled_back"), 60)
    assert _statuses(col)[-1]["state"] == "committed", _statuses(col)[-1]
