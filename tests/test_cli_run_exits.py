"""`edge-agent run` ends the same way for every source it cannot serve (issue 18): a missing video, a file that
is not a video and a bundle path that is not there each give one line naming the key and the path; a source
that cannot open exits non-zero instead of idling (or exiting 0 with 0 results); --max-frames stops a run that
also has MQTT enabled."""

from __future__ import annotations

from pathlib import Path

from agentproc import AgentProcess, demo_config
from brokers import Broker


def _run(agent_process, tmp_path: Path, *extra: str, **cfg: object) -> AgentProcess:
    agent = agent_process(demo_config(tmp_path, loop=False, **cfg), args=extra)
    agent.run(240)
    return agent


def test_a_file_that_is_not_a_video_is_refused_and_run_exits_non_zero(tmp_path: Path, agent_process) -> None:
    fake = tmp_path / "clip.mp4"
    fake.write_text("this is a text file, not a video\n")
    out = _run(agent_process, tmp_path, source={"type": "video", "path": str(fake)})
    assert out.returncode == 1, out.log_text()[-2000:]
    refused = out.events("boot.config_refused")
    assert refused and refused[0]["reason"] == f"source.path: {fake} is not a video FFmpeg can open"
    assert out.out_text() == ""  # no results, and not a clean exit 0 that looks like an empty video


def test_a_missing_video_path_says_it_does_not_exist_and_run_exits_non_zero(tmp_path: Path, agent_process) -> None:
    missing = tmp_path / "nowhere.mp4"
    out = _run(agent_process, tmp_path, source={"type": "video", "path": str(missing)})
    assert out.returncode == 1, out.log_text()[-2000:]
    reasons = [e["reason"] for e in out.events("boot.config_refused")]
    assert reasons == [f"source.path: {missing} does not exist"]  # was: "is not a video file", up forever


def test_a_missing_bundle_is_one_line_in_not_serving_reason_not_a_traceback(tmp_path: Path, agent_process) -> None:
    missing = tmp_path / "no-such-bundle"
    agent = agent_process(demo_config(tmp_path, loop=False, bundle=str(missing))).start()
    agent.wait_event("health", timeout=120, count=2)
    agent.stop()
    want = f"key bundle: {missing} does not exist (set bundle: to a bundle directory)"
    assert [e["not_serving_reason"] for e in agent.events("health")][:2] == [want, want]
    assert not agent.events("job.failed")
    assert "Traceback" not in agent.log_text()


def test_max_frames_stops_run_also_when_mqtt_is_enabled(tmp_path: Path, agent_process) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        out = _run(agent_process, tmp_path, "--max-frames", "5", source={"loop": True}, mqtt={"enabled": True, "port": broker.port})
    finally:
        broker.stop()
    assert out.returncode == 0, out.log_text()[-2000:]
    assert [r["seq"] for r in out.results()] == [1, 2, 3, 4, 5]
