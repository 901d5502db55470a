"""sd_notify, tested against a datagram socket bound by the test, and through a real `edge-agent run`."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from agent.service.sdnotify import Notifier
from agentproc import AgentProcess, demo_config
from waiting import wait_until


class NotifySocket:
    def __init__(self, path: Path | None = None, abstract: str | None = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            self.sock.bind("\0" + abstract)
            self.address = "@" + abstract
        else:
            self.sock.bind(str(path))
            self.address = str(path)
        self.sock.settimeout(0.2)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._rx, daemon=True)
        self._t.start()

    def _rx(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            fields["_t"] = str(time.monotonic())
            self.messages.append(fields)

    def with_key(self, key: str) -> list[dict[str, str]]:
        return [m for m in list(self.messages) if key in m]

    def wait(self, pred, timeout: float = 30) -> bool:
        return wait_until(pred, timeout)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def test_notify_protocol_on_a_path_and_an_abstract_socket(tmp_path: Path) -> None:
    for kwargs in ({"path": tmp_path / "notify.sock"}, {"abstract": f"edge-agent-test-{os.getpid()}"}):
        rx = NotifySocket(**kwargs)
        n = Notifier({"NOTIFY_SOCKET": rx.address, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_s == 2.0
        assert n.ready("serving x")
        assert n.watchdog()
        assert n.reloading()
        assert n.stopping()
        assert rx.wait(lambda: len(rx.messages) == 4, 30)
        assert rx.messages[0]["READY"] == "1" and rx.messages[0]["STATUS"] == "serving x"
        assert rx.messages[1] == {"WATCHDOG": "1", "_t": rx.messages[1]["_t"]}
        assert rx.messages[2]["RELOADING"] == "1" and int(rx.messages[2]["MONOTONIC_USEC"]) > 0
        assert rx.messages[3]["STOPPING"] == "1"
        rx.close()


def test_outside_systemd_notify_is_a_no_op_and_a_foreign_watchdog_pid_is_ignored() -> None:
    assert not Notifier({}).enabled and not Notifier({}).ready("x")
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None


def _run(agent_process, tmp_path: Path, rx: NotifySocket, watchdog_usec: int, **cfg_overrides) -> AgentProcess:
    cfg = demo_config(tmp_path, source={"max_fps": 50}, output={"stdout": False, "health_interval_s": 1})
    cfg.update(cfg_overrides)  # a whole source replaced, not merged
    return agent_process(cfg, env={"NOTIFY_SOCKET": rx.address, "WATCHDOG_USEC": str(watchdog_usec)}).start()


def test_agent_is_ready_only_after_the_selftest_pings_while_serving_reloads_and_stops(tmp_path: Path,
                                                                                      agent_process) -> None:
    rx = NotifySocket(tmp_path / "n.sock")
    agent = _run(agent_process, tmp_path, rx, 2_000_000)
    try:
        assert rx.wait(lambda: rx.with_key("READY"), 60), agent.log_text()[-2000:]
        ready = rx.with_key("READY")[0]
        assert ready["STATUS"].startswith("serving digits-classifier v1 ") and "CPUExecutionProvider" in ready["STATUS"]
        report = json.loads((tmp_path / "state" / "selftest" / "report.json").read_text())
        assert report["passed"]  # written before READY
        assert rx.wait(lambda: len(rx.with_key("WATCHDOG")) >= 3, 30)
        agent.signal(signal.SIGHUP)
        assert rx.wait(lambda: rx.with_key("RELOADING") and len(rx.with_key("READY")) >= 2, 90)
        assert float(rx.with_key("READY")[-1]["_t"]) > float(rx.with_key("RELOADING")[0]["_t"])
        assert agent.stop() == 0
        # sent before the agent exited; the receiving thread may read it a moment after the exit
        assert rx.wait(lambda: rx.with_key("STOPPING"), 10)
    finally:
        rx.close()


def test_not_serving_is_still_ready_and_says_so(tmp_path: Path, tiny_bundle: Path, agent_process) -> None:
    from agent.testing import rewrite_manifest

    rewrite_manifest(tiny_bundle, lambda d: d["selftest"].update(latency_budget_ms={"default": 0.0001}))
    rx = NotifySocket(tmp_path / "n.sock")
    _run(agent_process, tmp_path, rx, 0, bundle=str(tiny_bundle), selection={"latency_retries": 0})  # no re-runs: fails anyway
    try:
        assert rx.wait(lambda: rx.with_key("READY"), 60)
        assert rx.with_key("READY")[0]["STATUS"].startswith("NOT serving: no candidate passed")
    finally:
        rx.close()


def test_a_hung_source_stops_the_watchdog_pings(tmp_path: Path, agent_process) -> None:
    # a "camera" that accepts the connection and never answers; OpenCV's time-outs are set far away
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    rx = NotifySocket(tmp_path / "n.sock")
    source = {"type": "stream", "url": f"http://127.0.0.1:{srv.getsockname()[1]}/cam.mjpg",
              "open_timeout_ms": 600000, "read_timeout_ms": 600000}
    agent = _run(agent_process, tmp_path, rx, 2_000_000, source=source)
    try:
        assert rx.wait(lambda: rx.with_key("READY"), 60)
        assert rx.wait(lambda: any(m.get("STATUS", "").startswith("STALLED: capture stuck") for m in rx.messages), 60)
        last_ping = float(rx.with_key("WATCHDOG")[-1]["_t"]) if rx.with_key("WATCHDOG") else 0.0
        # barrier: four more ping times came and each was withheld (logged), rather than a fixed sleep
        n = len(agent.events("watchdog.withheld"))
        agent.wait_event("watchdog.withheld", timeout=60, count=n + 4)
        assert not any(float(m["_t"]) > last_ping for m in rx.with_key("WATCHDOG"))  # systemd would restart us
    finally:
        agent.kill()
        srv.close()
        rx.close()
