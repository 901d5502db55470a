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
import yaml  # noqa: E402

from brokers import Broker, Collector  # noqa: E402
from waiting import end_process, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "dev-seams"
PREFIX = f"edge/{DEVICE}/"


@pytest.fixture(scope="module")
def seam_kit(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_master: Path) -> dict:
    import cv2

    from agent.bundle.archive import pack
    from agent.bundle.signing import keygen, sign_bundle
    from agent.testing import rewrite_manifest, structured_frames

    d = tmp_path_factory.mktemp("seam-kit")
    keygen(d / "k.pem", d / "k.pub")
    frames = d / "frames"
    frames.mkdir()
    for i, f in enumerate(structured_frames(12, 40, seed=9)):
        cv2.imwrite(str(frames / f"{i:02d}.png"), f)
    shutil.copytree(tiny_bundle_master, d / "v1")  # the operator's seed, unsigned
    shutil.copytree(tiny_bundle_master, d / "v2")
    rewrite_manifest(d / "v2", lambda m: m.update(version=2))
    sign_bundle(d / "v2", d / "k.pem")
    return {"dir": d, "frames": frames, "pub": d / "k.pub", "v1": d / "v1", "v2": pack(d / "v2", d / "v2.tar.gz")}


def _agent(tmp: Path, kit: dict, port: int, **updates) -> subprocess.Popen:
    cfg = {
        "device_id": DEVICE, "state_dir": str(tmp / "state"), "bundle": str(kit["v1"]),
        "source": {"type": "folder", "path": str(kit["frames"]), "loop": True, "max_fps": 30},
        "output": {"stdout": False, "health_interval_s": 0.5},
        "mqtt": {"enabled": True, "port": port, "keepalive": 5, "reconnect_min_s": 1, "reconnect_max_s": 1},
        "updates": {"enabled": True, "trusted_keys": [str(kit["pub"])], "max_bundle_bytes": 2 * 2**20, **updates},
    }
    (tmp / "agent.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(tmp / "agent.yaml")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "agent.log", "a"),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


PUSH_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _push_v2(seam_kit: dict, port: int) -> list[str]:
    """`edge-agent push` of the kit's v2 bundle to the test device (prints each status, then exits)."""
    return [sys.executable, "-m", "agent", "push", "--device", DEVICE, "--bundle", str(seam_kit["v2"]),
            "--broker", f"127.0.0.1:{port}", "--timeout", "90"]


def _statuses(col: Collector) -> list[dict]:
    return [json.loads(m.payload) for m in col.on(PREFIX + "update/status")]


def test_sigterm_during_probation_does_not_commit_a_bundle_probation_never_watched(
        tmp_path: Path, seam_kit: dict) -> None:
    """Probation stops watching when the agent stops; the judge then saw a few clean frames and the
    updater committed the bundle after 0.1 s and 2 frames of a 3 s / 30 frame probation."""
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    agent = _agent(tmp_path, seam_kit, broker.port, probation_s=60.0, probation_frames=100000)
    pusher = None
    try:
        assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), (tmp_path / "agent.log").read_text()[-3000:]
        pusher = subprocess.Popen(_push_v2(seam_kit, broker.port), cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=PUSH_ENV)
        assert col.wait(lambda: any(s["state"] == "probation" for s in _statuses(col)), 90), \
            (tmp_path / "agent.log").read_text()[-3000:]
        end_process(agent)
        assert agent.returncode == 0
        # published before the agent exited; forwarded to this subscriber a moment later
        assert col.wait(lambda: _statuses(col)[-1]["state"] != "probation", 30), _statuses(col)[-1]
        final = _statuses(col)[-1]
        assert final["state"] == "rolled_back", final
        assert "shutdown" in final["reason"]
        store = tmp_path / "state" / "store"
        assert os.readlink(store / "committed") == os.readlink(store / "current")
        assert "-v1-" in os.readlink(store / "committed")
    finally:
        end_process(pusher, graceful=False)
        end_process(agent, graceful=False)
        col.c.loop_stop()
        broker.stop()


def test_update_while_paused_is_refused_as_paused_not_blamed_on_the_bundle(tmp_path: Path, seam_kit: dict) -> None:
    """`pause` stops frames; an update switched in then served nothing on probation and was rolled back as
    "zero results ... none served", blaming a good bundle for the operator's pause."""
    import paho.mqtt.publish as publish

    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    agent = _agent(tmp_path, seam_kit, broker.port, probation_s=2.0, probation_frames=20)
    try:
        assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), (tmp_path / "agent.log").read_text()[-3000:]
        publish.single(PREFIX + "cmd/pause", b"{}", qos=1, hostname="127.0.0.1", port=broker.port)
        assert col.wait(lambda: col.on(PREFIX + "cmd/pause/reply"), 30)
        out = subprocess.run(_push_v2(seam_kit, broker.port), cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=PUSH_ENV)
        final = json.loads(out.stdout.strip().splitlines()[-1])
        assert final["state"] != "committed", final
        assert "paused" in final["reason"] and "zero results" not in final["reason"], final
        assert agent.poll() is None
        store = tmp_path / "state" / "store"
        assert "-v1-" in os.readlink(store / "current") and "-v1-" in os.readlink(store / "committed")
    finally:
        end_process(agent)
        col.c.loop_stop()
        broker.stop()


def test_a_key_removed_from_trusted_keys_by_reload_no_longer_verifies_updates(tmp_path: Path, seam_kit: dict) -> None:
    """SIGHUP re-read the config but the updater kept the updates settings it started with: a signing key
    the operator removed from updates.trusted_keys (a revocation) still verified pushed bundles."""
    import signal

    from agent.bundle.signing import keygen

    keygen(tmp_path / "new.pem", tmp_path / "new.pub")
    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    agent = _agent(tmp_path, seam_kit, broker.port, probation_s=1.0, probation_frames=10)
    try:
        assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), (tmp_path / "agent.log").read_text()[-3000:]
        cfg = yaml.safe_load((tmp_path / "agent.yaml").read_text())
        cfg["updates"]["trusted_keys"] = [str(tmp_path / "new.pub")]  # the old key is revoked
        (tmp_path / "agent.yaml").write_text(yaml.safe_dump(cfg))
        agent.send_signal(signal.SIGHUP)
        assert wait_until(lambda: '"reload.start"' in (tmp_path / "agent.log").read_text(), 60)
        n = len(col.on(PREFIX + "health"))
        assert col.wait(lambda: len(col.on(PREFIX + "health")) > n + 2
                        and json.loads(col.on(PREFIX + "health")[-1].payload)["serving"], 60)
        out = subprocess.run(_push_v2(seam_kit, broker.port), cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=PUSH_ENV)
        final = json.loads(out.stdout.strip().splitlines()[-1])
        assert final["state"] == "rejected", final
        assert "-v1-" in os.readlink(tmp_path / "state" / "store" / "committed")
    finally:
        end_process(agent)
        col.c.loop_stop()
        broker.stop()


@pytest.mark.parametrize("url", ["http://[::1", "https://[fe80::1%zz/x", "http://127.0.0.1:port/x"])
def test_a_malformed_url_is_refused_with_a_reason_not_a_traceback(url: str) -> None:
    """urlsplit's ValueError (an unclosed IPv6 bracket) escaped check_url: the update command logged a
    traceback, replied "ValueError: Invalid IPv6 URL" and published no update status."""
    from agent.updates.delivery import UrlRefused, check_url

    with pytest.raises(UrlRefused, match="malformed URL"):
        check_url(url, allow_http=False)


def test_pause_during_probation_is_busy_not_a_rollback_of_a_good_bundle(tmp_path: Path, seam_kit: dict) -> None:
    """A `pause` accepted while an update was on probation starved the judge: the good bundle was rolled
    back as "zero results". While an update or rollback runs, pause answers busy."""
    import paho.mqtt.publish as publish

    broker = Broker(tmp_path / "broker").start()
    col = Collector(broker.port, [PREFIX + "#"])
    agent = _agent(tmp_path, seam_kit, broker.port, probation_s=4.0, probation_frames=100000)
    pusher = None
    try:
        assert col.wait(lambda: col.on(PREFIX + "predictions"), 60), (tmp_path / "agent.log").read_text()[-3000:]
        pusher = subprocess.Popen(_push_v2(seam_kit, broker.port), cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=PUSH_ENV)
        assert col.wait(lambda: any(s["state"] == "probation" for s in _statuses(col)), 90)
        publish.single(PREFIX + "cmd/pause", b"{}", qos=1, hostname="127.0.0.1", port=broker.port)
        assert col.wait(lambda: col.on(PREFIX + "cmd/pause/reply"), 30)
        reply = json.loads(col.on(PREFIX + "cmd/pause/reply")[-1].payload)
        assert reply["ok"] is False and reply.get("busy"), reply
        assert col.wait(lambda: _statuses(col)[-1]["state"] in ("committed", "rolled_back"), 60)
        assert _statuses(col)[-1]["state"] == "committed", _statuses(col)[-1]
    finally:
        end_process(pusher, graceful=False)
        end_process(agent)
        col.c.loop_stop()
        broker.stop()
