"""Logs say what is wrong and nothing else (issue 18): a broker retry and a clean stop log no error-level line,
and ONNX Runtime's telemetry warning (HOME unwritable, as under the shipped unit) never breaks one JSON object
per line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from brokers import Broker, free_port
from waiting import end_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _config(tmp_path: Path, port: int) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump({
        "state_dir": str(tmp_path / "state"), "bundle": str(DEMO),
        "source": {"type": "folder", "path": str(FRAMES), "loop": True, "max_fps": 20},
        "output": {"stdout": False, "health_interval_s": 0.5},
        "mqtt": {"enabled": True, "host": "127.0.0.1", "port": port, "reconnect_min_s": 1, "reconnect_max_s": 1},
    }))
    return p


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _start(cfg: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)


def test_broker_retries_are_warnings_not_client_errors(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    proc = _start(_config(tmp_path, free_port()), log)  # nothing listens there: every connect fails
    try:
        # barrier: three failed connects, each followed (on the old code) by paho's "not connected" ERR line
        assert wait_until(lambda: sum(e["event"] == "mqtt.connect_failed" for e in _lines(log)) >= 3, timeout=120), \
            log.read_text()[-2000:]
    finally:
        end_process(proc)
    events = _lines(log)
    errors = [e for e in events if e["level"] == "error"]
    assert not errors, json.dumps(errors)[:3000]
    assert all(e["level"] == "warning" for e in events if e["event"] == "mqtt.connect_failed")


def test_a_clean_stop_logs_no_error_and_no_disconnect_warning(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    log = tmp_path / "agent.log"
    proc = _start(_config(tmp_path, broker.port), log)
    try:
        assert wait_until(lambda: any(e["event"] == "mqtt.connected" for e in _lines(log))
                          and any(e["event"] == "health" and e["serving"] for e in _lines(log)), timeout=120), \
            log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        end_process(proc)
        broker.stop()
    events = _lines(log)
    errors = [e for e in events if e["level"] == "error"]
    assert not errors, json.dumps(errors)[:3000]
    gone = [e for e in events if e["event"] == "mqtt.disconnected"]
    assert all(e["level"] == "info" for e in gone), gone


def _unit_environment() -> dict[str, str]:
    env = {}
    for line in (ROOT / "systemd" / "edge-agent.service").read_text().splitlines():
        if line.startswith("Environment="):
            k, _, v = line.removeprefix("Environment=").partition("=")
            env[k] = v
    return env


def test_every_stderr_line_is_json_with_an_unwritable_home_under_the_units_environment(tmp_path: Path) -> None:
    unit_env = _unit_environment()
    assert unit_env.get("ORT_DISABLE_TELEMETRY") == "1"
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env.update(unit_env, HOME="/proc/edge-agent-no-home", XDG_CACHE_HOME="/proc/edge-agent-no-home/.cache")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO),
                                   "source": {"type": "folder", "path": str(FRAMES)}}))
    out = subprocess.run([sys.executable, "-m", "agent", "--log-json", "run", "--config", str(cfg), "--max-frames", "3"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    bad = [line for line in out.stderr.splitlines() if not line.startswith("{")]
    assert not bad, bad
    for line in out.stderr.splitlines():
        json.loads(line)


def test_the_cli_alone_keeps_onnxruntime_quiet_when_home_is_unwritable(tmp_path: Path) -> None:
    # not through the unit: a user's `edge-agent --log-json run` as a service account gets the same
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env.update(HOME="/proc/edge-agent-no-home", XDG_CACHE_HOME="/proc/edge-agent-no-home/.cache",
               XDG_STATE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "agent", "--log-json", "run", "--max-frames", "2"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if not line.startswith("{")] == []
