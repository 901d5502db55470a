"""Review of issue 43 point 4 ("the agent boots, connects and says 'disk full' in health when its state disk is
full"). tests/service/test_boot_full_disk.py fills a state dir that holds only a `boots` file. A device that ran before
with MQTT on has its outbox (`outbox.sqlite`, its `.held` and `.lost` counters) on that disk. Booted again once
the disk is full, SQLite raises `OperationalError: disk I/O error` (not "full", not ENOSPC), which
`links.start_mqtt` re-raised: `edge-agent: internal error: OperationalError: disk I/O error`, exit 1, nothing
served, never connected; under the unit's restart limit the device stayed down. Now any error opening the
outbox on the state disk falls back to the outbox in memory, said (`outbox.state_disk_full` when the disk is
full), and the device serves."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agentproc import demo_config
from brokers import Broker
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture


@pytest.mark.slow
@pytest.mark.parametrize("broker_up", [False, True])
def test_a_device_that_ran_before_boots_on_a_full_state_disk(tmp_path: Path, small_disk: Path, agent_process,  # noqa: F811
                                                             broker_up: bool) -> None:
    broker = Broker(tmp_path / "broker").start() if broker_up else None
    if broker is not None:
        port = broker.port
    else:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nobody listens: the broker is away
    try:
        cfg = demo_config(tmp_path, port=port, device_id="dev-r43b-full", state_dir=str(small_disk / "state"),
                          source={"max_fps": 30})
        a0 = agent_process(cfg, name="boot0").start()
        a0.wait_results(5, timeout=180)
        assert a0.stop(60) == 0
        fill(small_disk)
        a1 = agent_process(cfg, name="boot1").start()
        try:
            a1.wait(lambda: a1.results() or a1.returncode is not None, timeout=180, what="a result or an exit")
        finally:
            rc = a1.returncode
            if rc is None:
                a1.stop(60)
        assert a1.results(), f"exit {rc}: {a1.log_text()[-600:]}"
    finally:
        if broker is not None:
            broker.stop()
