"""The MQTT link's reconnect schedule is jittered per device (issue 18): paho's own backoff doubles from a fixed
first delay, so agents that lost one broker would retry together; each link draws its own first delay."""

from __future__ import annotations

from pathlib import Path


def test_each_link_draws_its_own_first_reconnect_delay(tmp_path: Path) -> None:
    from agent.config import MqttConfig, OutboxConfig
    from agent.link.mqtt import MqttLink
    from agent.link.outbox import Outbox

    cfg = MqttConfig(enabled=True, port=1, reconnect_min_s=2, reconnect_max_s=30)
    delays = []
    for i in range(8):
        outbox = Outbox(tmp_path / f"outbox-{i}.sqlite", OutboxConfig())
        link = MqttLink(cfg, f"dev-{i}", tmp_path, outbox, lambda *a: None, dict)
        # paho keeps the schedule in private attributes; read, never set
        delays.append((link.client._reconnect_min_delay, link.client._reconnect_max_delay))
        outbox.close()
    assert all(1.0 <= lo <= 3.0 and hi == 30 for lo, hi in delays), delays
    assert len({lo for lo, _ in delays}) == len(delays)  # not one shared schedule
