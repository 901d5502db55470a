"""Source reconnects back off with jitter (issue 18): a fleet of cameras that lost one network must not retry in
lock-step. A real stream source against a closed local port; the random draw is recorded, not replaced."""

from __future__ import annotations

import random
import threading

import pytest

from brokers import free_port
from waiting import wait_until


def test_each_reconnect_wait_is_a_jittered_fraction_of_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.config import SourceConfig
    from agent.serving import sources
    from agent.vocabulary.manifest import FrameSpec

    draws: list[tuple[float, float, float]] = []
    real_uniform = random.uniform

    def recording_uniform(a: float, b: float) -> float:
        v = real_uniform(a, b)
        draws.append((a, b, v))
        return v

    monkeypatch.setattr(sources.random, "uniform", recording_uniform)
    cfg = SourceConfig(type="stream", url=f"http://127.0.0.1:{free_port()}/mjpeg", reconnect_initial_s=0.05,
                       reconnect_max_s=0.2, open_timeout_ms=500)
    src = sources.open_source(cfg, FrameSpec(kind="image", height=28, width=28, channels=3, color="rgb"))
    stop = threading.Event()
    t = threading.Thread(target=src.read, args=(stop,), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(draws) >= 4, timeout=60), draws
    finally:
        stop.set()
        t.join(timeout=30)
        src.close()
    assert all((a, b) == (0.5, 1.0) and a <= v <= b for a, b, v in draws)
    assert len({round(v, 9) for _, _, v in draws}) == len(draws)  # not one fixed factor
    assert src.stats.state == "lost" and src.stats.losses == 1
