"""The `edge-agent` command line, run as a user would: a real process, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentproc import demo_config

ROOT = Path(__file__).resolve().parents[2]
DEMO, FRAMES = ROOT / "models" / "digits-classifier", ROOT / "models" / "demo-frames" / "digits"


def edge_agent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands() -> None:
    out = edge_agent("--help")
    assert out.returncode == 0
    for cmd in ("bundle", "providers", "selftest", "config"):
        assert cmd in out.stdout


def test_demo_bundle_verifies_and_inspects(demo_bundle: Path) -> None:
    out = edge_agent("bundle", "verify", str(demo_bundle))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK digits-classifier@")
    out = edge_agent("bundle", "inspect", str(demo_bundle))
    assert out.returncode == 0 and "int8" in out.stdout and "Conv" in out.stdout
    doc = json.loads(edge_agent("bundle", "inspect", "--json", str(demo_bundle)).stdout)
    q = {v["name"]: v["quality"] for v in doc["variants"]}
    # the bar: INT8 held-out top-1 within 1.0 point of FP32
    assert q["fp32"]["heldout_top1"] - q["int8"]["heldout_top1"] <= 0.01


def test_demo_selftest_json_selects_a_cpu_candidate_with_evidence(demo_bundle: Path, tmp_path: Path) -> None:
    out = edge_agent("selftest", "--bundle", str(demo_bundle), "--json", "--state-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["selected"]["provider"] == "CPUExecutionProvider"
    tested = [c for c in doc["candidates"] if c["status"] == "tested"]
    assert tested and all(c["placement"] and c["parity"] and c["latency"] for c in tested)
    assert json.loads((tmp_path / "selftest" / "report.json").read_text())["cache_key"] == doc["cache_key"]


def test_selftest_that_selects_nothing_exits_3_with_a_one_line_reason(tiny_bundle: Path, tmp_path: Path) -> None:
    from agent.testing import rewrite_manifest

    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(latency_budget_ms={"default": 0.0001}))
    out = edge_agent("selftest", "--bundle", str(tiny_bundle), "--state-dir", str(tmp_path), "--latency-retries", "0")
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1].startswith("edge-agent: no candidate passed: ")


def test_pinning_an_unusable_provider_is_a_clear_error(tiny_bundle: Path, tmp_path: Path) -> None:
    out = edge_agent("selftest", "--bundle", str(tiny_bundle), "--state-dir", str(tmp_path),
                     "--provider", "CUDAExecutionProvider")
    assert out.returncode == 1
    assert "CUDAExecutionProvider is not usable on this device" in out.stderr


def test_pack_unpack_and_verify_a_tarball(tiny_bundle: Path, tmp_path: Path) -> None:
    tgz = tmp_path / "b.tar.gz"
    assert edge_agent("bundle", "pack", str(tiny_bundle), str(tgz)).returncode == 0
    assert edge_agent("bundle", "verify", str(tgz)).returncode == 0
    out = edge_agent("bundle", "unpack", str(tgz), str(tmp_path / "u"))
    assert out.returncode == 0 and (tmp_path / "u" / "bundle.yaml").exists()


def test_verify_of_a_corrupt_bundle_exits_1_naming_the_file(tiny_bundle: Path) -> None:
    (tiny_bundle / "model_fp32.onnx").write_bytes(b"junk")
    out = edge_agent("bundle", "verify", str(tiny_bundle))
    assert out.returncode == 1
    assert "model_fp32.onnx: hash mismatch" in out.stderr
    assert "copy or unpack the bundle again, or rebuild it" in out.stderr  # the fix, not only both hashes


def test_providers_json_reports_cpu_usable() -> None:
    out = edge_agent("providers", "--json")
    statuses = {s["name"]: s for s in json.loads(out.stdout)}
    assert statuses["CPUExecutionProvider"]["usable"] is True
    assert statuses["CPUExecutionProvider"]["nodes_on_provider"] > 0


def test_config_check_prints_effective_settings_or_names_the_bad_key(tmp_path: Path) -> None:
    good = tmp_path / "a.yaml"
    good.write_text(f"device_id: d1\nbundle: {DEMO}\nsource: {{type: folder, path: {FRAMES}}}\n")
    out = edge_agent("config", "check", str(good))
    assert out.returncode == 0 and json.loads(out.stdout)["device_id"] == "d1"
    bad = tmp_path / "b.yaml"
    bad.write_text("devce_id: d1\n")
    out = edge_agent("config", "check", str(bad))
    assert out.returncode == 1 and "b.yaml: key devce_id: unknown key" in out.stderr


# -- the shell speaks one language (issue 12) -----------------------------------------------------------------
def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-agent: ") and "Traceback" not in err, err
    return lines[0]


def test_push_to_an_unreachable_broker_is_one_line_not_a_connection_refused_traceback(tmp_path: Path) -> None:
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(b"x")
    out = edge_agent("push", "--device", "d", "--bundle", str(archive), "--broker", "127.0.0.1:1")
    assert out.returncode == 1
    assert "cannot reach the broker 127.0.0.1:1" in _one_line(out.stderr) and "--broker" in out.stderr


def test_push_of_a_missing_file_is_one_line_not_a_file_not_found_traceback(tmp_path: Path) -> None:
    out = edge_agent("push", "--device", "d", "--bundle", str(tmp_path / "nope.tar.gz"))
    assert out.returncode == 1 and "nope.tar.gz: no such file or directory" in _one_line(out.stderr)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    out = edge_agent("push", "--device", "d", "--bundle", str(tmp_path / "nope.tar.gz"), "--debug")
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_config_check_piped_into_head_is_quiet_not_a_broken_pipe_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"bundle: {DEMO}\nsource: {{type: folder, path: {FRAMES}}}\n")
    out = subprocess.run(f"{sys.executable} -m agent config check {cfg} | head -1", shell=True, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout == "{\n" and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_keygen_twice_refuses_to_replace_the_private_key_without_force(tmp_path: Path) -> None:
    args = ("bundle", "keygen", "--private", str(tmp_path / "k.pem"), "--public", str(tmp_path / "k.pub"))
    assert edge_agent(*args).returncode == 0
    first = (tmp_path / "k.pem").read_bytes()
    out = edge_agent(*args)
    assert out.returncode == 2 and "--force" in _one_line(out.stderr)
    assert (tmp_path / "k.pem").read_bytes() == first
    assert edge_agent(*args, "--force").returncode == 0 and (tmp_path / "k.pem").read_bytes() != first


@pytest.mark.parametrize("text, problem", [
    ("", "key source.path: source type folder needs a path"),
    ("bundle: nowhere\nsource: {type: folder, path: .}", "key bundle:"),
    (f"bundle: {FRAMES}\nsource: {{type: folder, path: .}}", "key bundle:"),
    (f"bundle: {DEMO}\nsource: {{type: folder, path: missing-frames}}", "missing-frames does not exist"),
    (f"bundle: {DEMO}\nsource: {{type: folder, path: {FRAMES}}}\npipeline: {{inference_workers: -3}}",
     "key pipeline.inference_workers: expected >= 0, found -3"),
    (f"bundle: {DEMO}\nsource: {{type: folder, path: {FRAMES}}}\nupdates: {{keep: 0}}",
     "key updates.keep: expected >= 1, found 0"),
])
def test_config_check_refuses_a_config_that_cannot_serve(tmp_path: Path, text: str, problem: str) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text(text)
    out = edge_agent("config", "check", str(cfg))
    assert out.returncode == 1 and problem in _one_line(out.stderr), out.stderr


def test_config_check_masks_the_mqtt_password(tmp_path: Path) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"bundle: {DEMO}\nsource: {{type: folder, path: {FRAMES}}}\nmqtt: {{password: hunter2}}\n")
    out = edge_agent("config", "check", str(cfg))
    assert out.returncode == 0 and "hunter2" not in out.stdout + out.stderr
    assert json.loads(out.stdout)["mqtt"]["password"] == "***"


def test_config_check_accepts_the_shipped_systemd_config_with_its_placeholders() -> None:
    out = edge_agent("config", "check", str(ROOT / "systemd" / "agent.yaml"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["bundle"] == "/opt/edge-agent/share/models/digits-classifier"
    assert "@PREFIX@ placeholders read as /opt/edge-agent" in out.stderr


def test_global_options_are_accepted_after_the_command_and_every_command_has_a_description() -> None:
    out = edge_agent("config", "check", "--log-json", "--log-level", "error", str(ROOT / "systemd" / "agent.yaml"))
    assert out.returncode == 0, out.stderr
    for cmd in (["run"], ["selftest"], ["push"], ["monitor"], ["providers"], ["bundle", "verify"], ["config", "check"]):
        h = edge_agent(*cmd, "--help").stdout
        usage_end = h.index("\n\n")
        assert h[usage_end:].strip().split("\n")[0] and not h[usage_end:].lstrip().startswith(("options:", "positional")), cmd


def test_cli_state_dir_defaults_to_the_users_not_the_services(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "agent", "--log-level", "error", "selftest", "--bundle", str(DEMO),
                          "--json"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "xdg" / "edge-agent" / "selftest" / "report.json").exists()


def test_log_level_from_the_config_is_honoured(tmp_path: Path, agent_process) -> None:
    cfg = demo_config(tmp_path, loop=False, output={"stdout": False}, log={"level": "error", "json": True})
    agent = agent_process(cfg, log_args=(), args=("--max-frames", "3"))  # no --log-json: the config's log
    assert agent.run(300) == 0, agent.log_text()
    assert '"level": "info"' not in agent.log_text() and "boot.ready" not in agent.log_text()


def test_selftest_with_a_state_dir_it_cannot_write_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = edge_agent("selftest", "--bundle", str(DEMO), "--state-dir", str(blocker / "state"))
    assert out.returncode == 1 and str(blocker) in _one_line(out.stderr), out.stderr


def test_stream_reconnects_leave_no_opencv_or_ffmpeg_lines_in_the_json_log(tmp_path: Path, agent_process) -> None:
    from slow_servers import tcp_server

    # a camera that accepts and hangs up at once: every open fails, and each attempt is counted here
    attempts: list[int] = []
    srv = tcp_server(lambda conn: (attempts.append(1), conn.close()))
    cfg = demo_config(tmp_path, output={"stdout": False})
    cfg["source"] = {"type": "stream", "url": f"http://127.0.0.1:{srv.getsockname()[1]}/cam.mjpg",
                     "open_timeout_ms": 500, "read_timeout_ms": 500, "reconnect_initial_s": 0.2, "reconnect_max_s": 0.5}
    agent = agent_process(cfg).start()
    try:
        agent.wait_event("source.lost")
        agent.wait(lambda: len(attempts) >= 4, 60, "four reconnect attempts")  # a barrier: each had its chance to log
    finally:
        assert agent.stop() == 0
        srv.close()
    lines = [ln for ln in agent.log_text().splitlines() if ln.strip()]
    assert [ln for ln in lines if not ln.startswith("{")] == []


def test_monitor_of_an_unreachable_broker_says_the_cause_and_the_fix_as_push_does() -> None:
    """Fault: `monitor` said only "cannot reach the broker at 127.0.0.1:1" (no cause, no fix) where push says both."""
    out = edge_agent("monitor", "--broker", "127.0.0.1:1", "--once", "--wait", "0")
    assert out.returncode == 1
    line = _one_line(out.stderr)
    assert "cannot reach the broker 127.0.0.1:1: Connection refused; is it running and listening there?" in line
    assert "(--broker HOST:PORT)" in line


def test_selftest_ends_on_ctrl_c_even_when_sigint_came_in_ignored_and_says_so(tmp_path: Path) -> None:
    """Fault: started with SIGINT ignored (a script, cron, CI), `selftest` ran a 74 s proof to its end through
    Ctrl-C, and printed no "interrupted" line on a terminal either."""
    import signal
    import time

    from agentproc import parse_events

    err = tmp_path / "err.log"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-json", "selftest", "--bundle", str(DEMO),
                                 "--state-dir", str(tmp_path / "state"), "--no-cache", "--latency-runs", "100000"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        end = time.monotonic() + 120
        while not any(e.get("event") == "selftest.child_started" for e in parse_events(err.read_text())):
            assert proc.poll() is None and time.monotonic() < end, err.read_text()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, err.read_text()[-2000:]
    assert "edge-agent: selftest interrupted (Ctrl-C)" in err.read_text()
