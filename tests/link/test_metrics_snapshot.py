"""/metrics reads the health document the controller last published, never live state from its HTTP
thread (issue 20: scrapes read live engine, pipeline and outbox state on the HTTP thread)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("prometheus_client")


class _Source:
    """A metrics source whose live health must not be read by a scrape."""

    def __init__(self) -> None:
        self.published = {"device_id": "dev-s", "serving": True, "uptime_s": 12.5, "pipeline": None}

    def health(self) -> dict[str, Any]:
        raise AssertionError("a scrape read the live health on the HTTP thread")

    def health_snapshot(self) -> dict[str, Any]:
        return self.published

    def pipeline_metrics(self) -> Any:
        return None


def test_a_scrape_reads_the_published_snapshot_not_the_live_state() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.link.prometheus import _Collector

    registry = CollectorRegistry()
    registry.register(_Collector(_Source()))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "edge_agent_serving 1.0" in text and "edge_agent_uptime_seconds 12.5" in text


def test_before_the_first_publish_the_controller_says_it_is_starting(tmp_path) -> None:
    from agent.config import Config
    from agent.service.controller import Controller

    c = Controller(Config(state_dir=tmp_path / "state"))
    snap = c.health_snapshot()
    assert snap["serving"] is False and snap["not_serving_reason"] == "starting"
