"""Logs say what is wrong and nothing else (issue 18): a broker retry and a clean stop log no error-level line,
and ONNX Runtime's telemetry warning (HOME unwritable, as under the shipped unit) never breaks one JSON object
per line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentproc import ROOT, AgentProcess, demo_config
from brokers import Broker, free_port



def _agent(agent_process, tmp_path: Path, port: int) -> AgentProcess:
    return agent_process(demo_config(tmp_path, port=port, source={"max_fps": 20}, output={"stdout": False})).start()


def test_broker_retries_are_warnings_not_client_errors(tmp_path: Path, agent_process) -> None:
    agent = _agent(agent_process, tmp_path, free_port())  # nothing listens there: every connect fails
    # barrier: three failed connects, each followed (on the old code) by paho's "not connected" ERR line
    agent.wait_event("mqtt.connect_failed", timeout=120, count=3)
    agent.stop()
    events = agent.events()
    errors = [e for e in events if e["level"] == "error"]
    assert not errors, json.dumps(errors)[:3000]
    assert all(e["level"] == "warning" for e in events if e["event"] == "mqtt.connect_failed")


def test_a_clean_stop_logs_no_error_and_no_disconnect_warning(tmp_path: Path, agent_process) -> None:
    broker = Broker(tmp_path / "broker").start()
    agent = _agent(agent_process, tmp_path, broker.port)
    try:
        agent.wait_event("mqtt.connected", timeout=120)
        agent.wait_event("health", lambda e: e["serving"], timeout=120)
        assert agent.stop(60) == 0
    finally:
        broker.stop()
    events = agent.events()
    assert agent.events("shutdown")  # the stop ran to its end (the exit is the barrier)
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


def test_every_stderr_line_is_json_with_an_unwritable_home_under_the_units_environment(tmp_path: Path,
                                                                                      agent_process) -> None:
    unit_env = _unit_environment()
    assert unit_env.get("ORT_DISABLE_TELEMETRY") == "1"
    env = {"ORT_DISABLE_TELEMETRY": None, **unit_env, "HOME": "/proc/edge-agent-no-home",
           "XDG_CACHE_HOME": "/proc/edge-agent-no-home/.cache"}
    agent = agent_process(demo_config(tmp_path, loop=False), env=env, args=("--max-frames", "3"))
    assert agent.run(240) == 0, agent.log_text()[-2000:]
    bad = [line for line in agent.log_text().splitlines() if not line.startswith("{")]
    assert not bad, bad
    for line in agent.log_text().splitlines():
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
