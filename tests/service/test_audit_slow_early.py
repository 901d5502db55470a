"""Review of issue 43 ("a variant that turns 5x slower after boot is reported within the documented period": at most
`audit.slow_period_s` plus two intervals, 42 s at the defaults). slowness.SlowWatch takes its baseline from the
engine's first two intervals after a warm one (6-18 s of serving at the default 30 s period) and never revises it.
A variant that turns 5x slower inside that window has the slow part averaged into its baseline. Seen: slowdown at
inference 300 (16:31:46), baseline taken at 16:31:50 (12.2 ms, partly slow), audit.slow at 16:32:51: 65 s after the
slowdown, over the documented 42 s. (Expected from the code: with more of the slow part inside the baseline, the
ratio stays under the factor and it is never reported.) tests/service/test_audit_slow.py passes because its short period
puts inference 300 after the baseline."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest

from agentproc import demo_config, int8_first

INT8 = "CPUExecutionProvider:int8"


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
def test_a_variant_turning_slow_10_s_after_serving_began_is_reported(tmp_path: Path, agent_process) -> None:
    cfg = int8_first(tmp_path, demo_config(tmp_path, source={"max_fps": 30}, output={"stdout": False},
                                           audit={"canary_period_s": 3600, "live_period_s": 3600}))
    agent = agent_process(cfg, env={"EDGE_AGENT_FAULT": f"slow:{INT8}#300=5"}).start()
    try:
        agent.wait_event("boot.ready", timeout=180)
        began = agent.wait_event("serving.fault_slow", timeout=120)
        deadline = time.monotonic() + 100.0  # the documented period is 42 s
        while time.monotonic() < deadline and not agent.events("audit.slow"):
            time.sleep(1.0)
        slow = agent.events("audit.slow")
        base = agent.events("audit.latency_baseline")
    finally:
        agent.stop(60)
    assert slow, (f"no audit.slow within 100 s of the slowdown (began {began['timestamp']}); "
                  f"baseline {[(b['inference_ms'], b['timestamp']) for b in base]}")
    assert _at(slow[0]) - _at(began) <= 42.0
