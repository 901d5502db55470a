"""`edge-agent run` ends the same way for every source it cannot serve (issue 18): a missing video, a file that
is not a video and a bundle path that is not there each give one line naming the key and the path; a source
that cannot open exits non-zero instead of idling (or exiting 0 with 0 results); --max-frames stops a run that
also has MQTT enabled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from brokers import Broker
from waiting import end_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _write(tmp_path: Path, **cfg: object) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO),
                                 "output": {"health_interval_s": 0.5}, **cfg}))
    return p


def _run(cfg: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_a_file_that_is_not_a_video_is_refused_and_run_exits_non_zero(tmp_path: Path) -> None:
    fake = tmp_path / "clip.mp4"
    fake.write_text("this is a text file, not a video\n")
    out = _run(_write(tmp_path, source={"type": "video", "path": str(fake)}))
    assert out.returncode == 1, out.stderr[-2000:]
    refused = [e for e in _events(out.stderr) if e["event"] == "boot.config_refused"]
    assert refused and refused[0]["reason"] == f"source.path: {fake} is not a video FFmpeg can open"
    assert out.stdout == ""  # no results, and not a clean exit 0 that looks like an empty video


def test_a_missing_video_path_says_it_does_not_exist_and_run_exits_non_zero(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.mp4"
    out = _run(_write(tmp_path, source={"type": "video", "path": str(missing)}))
    assert out.returncode == 1, out.stderr[-2000:]
    reasons = [e["reason"] for e in _events(out.stderr) if e["event"] == "boot.config_refused"]
    assert reasons == [f"source.path: {missing} does not exist"]  # was: "is not a video file", up forever


def test_a_missing_bundle_is_one_line_in_not_serving_reason_not_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-bundle"
    cfg = _write(tmp_path, bundle=str(missing), source={"type": "folder", "path": str(FRAMES)})
    log = tmp_path / "agent.log"
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)
    try:
        def health() -> list[dict]:
            return [e for e in _events(log.read_text()) if e["event"] == "health"]
        assert wait_until(lambda: len(health()) >= 2 or proc.poll() is not None, timeout=120), log.read_text()
    finally:
        end_process(proc)
    events = _events(log.read_text())
    want = f"key bundle: {missing} does not exist (set bundle: to a bundle directory)"
    assert [e["not_serving_reason"] for e in events if e["event"] == "health"][:2] == [want, want]
    assert not [e for e in events if e["event"] == "job.failed"]
    assert "Traceback" not in log.read_text()


def test_max_frames_stops_run_also_when_mqtt_is_enabled(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        cfg = _write(tmp_path, source={"type": "folder", "path": str(FRAMES), "loop": True},
                     mqtt={"enabled": True, "host": "127.0.0.1", "port": broker.port})
        out = _run(cfg, "--max-frames", "5")
    finally:
        broker.stop()
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(line)["seq"] for line in out.stdout.splitlines()] == [1, 2, 3, 4, 5]
