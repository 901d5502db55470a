"""`edge-agent push` and `edge-agent monitor` of one operator account run side by side against the shipped broker
config (issue 43): the real CLIs on the operators' listener (no use_username_as_clientid there, so each tool keeps
its own client id), a real agent on the devices' listener. Fault: under use_username_as_clientid every client of
the account was "operator": `push` died with "The client is not currently connected" while a `monitor` ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentproc import AgentProcess, demo_config
from brokers import MOSQUITTO, wait_port
from tests.link.test_broker_acl import USERS
from tests.link.test_broker_identity import ShippedListenersBroker
from update_kits import key_and_frames
from waiting import end_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                 reason="mosquitto is not installed (scripts/test.sh installs it)")]


class LoggingListenersBroker(ShippedListenersBroker):
    """The shipped listeners, the broker logging each connection and takeover (notice and information)."""

    def write_config(self) -> Path:
        conf = super().write_config()
        conf.write_text(conf.read_text() + "log_type notice\nlog_type information\n")
        return conf


def test_push_and_monitor_of_one_account_run_side_by_side(tmp_path: Path, tiny_bundle_master: Path) -> None:
    from agent.bundle.archive import pack
    from agent.bundle.signing import sign_bundle
    from agent.testing import rewrite_manifest

    frames = key_and_frames(tmp_path)
    shutil.copytree(tiny_bundle_master, tmp_path / "v1")
    shutil.copytree(tiny_bundle_master, tmp_path / "v2")
    rewrite_manifest(tmp_path / "v2", lambda m: m.update(version=2))
    sign_bundle(tmp_path / "v2", tmp_path / "k.pem")
    v2 = pack(tmp_path / "v2", tmp_path / "v2.tar.gz")
    secret = tmp_path / "operator.pw"
    secret.write_text(USERS["operator"])

    broker = LoggingListenersBroker(tmp_path / "broker").start()
    wait_port(broker.tools_port, 30)
    cfg = demo_config(tmp_path, port=broker.port, device_id="dev-a", bundle=str(tmp_path / "v1"),
                      source={"path": str(frames), "max_fps": 30}, output={"stdout": False},
                      updates={"enabled": True, "trusted_keys": [str(tmp_path / "k.pub")]})
    cfg["mqtt"].update(username="dev-a", password=USERS["dev-a"])
    agent = AgentProcess(tmp_path, cfg).start()
    tool = ["--broker", f"127.0.0.1:{broker.tools_port}", "--username", "operator", "--password-file", str(secret)]
    mon_out = tmp_path / "monitor.out"
    with mon_out.open("w") as out:
        monitor = subprocess.Popen([sys.executable, "-m", "agent", "monitor", "--json", *tool], cwd=ROOT, env=ENV,
                                   stdout=out, stderr=subprocess.PIPE, text=True)

    def rows() -> list[dict]:
        lines = [ln for ln in mon_out.read_text().splitlines() if ln.startswith("[")]
        return json.loads(lines[-1]) if lines else []

    try:
        agent.wait_event("boot.ready", timeout=180)
        assert wait_until(lambda: any(r["device"] == "dev-a" and r["availability"] == "online" for r in rows()), 60)
        push = subprocess.run([sys.executable, "-m", "agent", "push", "--device", "dev-a", "--bundle", str(v2),
                               "--timeout", "150", *tool], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=200)
        assert push.returncode == 0, push.stderr[-3000:]
        assert json.loads(push.stdout.strip().splitlines()[-1])["state"] == "committed"
        assert monitor.poll() is None, "the monitor died while push ran"
        # the monitor kept its session through the push: it sees the device serve the pushed version
        assert wait_until(lambda: any(r["device"] == "dev-a" and str(r.get("bundle")).endswith("@2") for r in rows()), 60), \
            rows()
    finally:
        end_process(monitor, graceful=True)
        agent.stop(60)
        broker.stop()
    assert "not currently connected" not in (monitor.stderr.read() if monitor.stderr else "")
    log = "".join(p.read_text() for p in (tmp_path / "broker").glob("mosquitto-*.log"))
    assert "already connected" not in log, [ln for ln in log.splitlines() if "already connected" in ln][:5]
