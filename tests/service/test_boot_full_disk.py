"""A boot with the state disk full: `run` exited 1 after 12 s with one non-JSON line (`edge-agent: No space
left on device`) and never connected, and under the unit's restart limit the device stayed down and silent.
Now it boots, connects, proves and serves with the proof's state in memory, and health says "disk full"
(a real 8 MiB tmpfs filled to its last byte, a real broker)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from agentproc import demo_config
from brokers import Broker, Collector
from tests.link.test_outbox_disk_full import pytestmark_agent
from full_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture

DEVICE = "dev-bootfull"
PREFIX = f"edge/{DEVICE}/"


@pytestmark_agent
def test_a_boot_with_the_state_disk_full_connects_serves_and_says_disk_full(tmp_path: Path, small_disk: Path,  # noqa: F811
                                                                            agent_process) -> None:
    state = small_disk / "state"
    state.mkdir()
    (state / "boots").write_text("4")  # the device ran before; then its disk filled
    fill(small_disk)
    scratch = Path("/dev/shm") / f"edge-agent-{hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]}"
    broker = Broker(tmp_path / "broker").start()
    sub = Collector(broker.port, [PREFIX + "predictions", PREFIX + "health"])
    agent = agent_process(demo_config(tmp_path, port=broker.port, device_id=DEVICE, state_dir=str(state),
                                      source={"max_fps": 30})).start()
    try:
        assert sub.wait(lambda: len(sub.on(PREFIX + "predictions")) >= 5, 120), agent.log_text()[-3000:]
        assert json.loads(sub.on(PREFIX + "predictions")[0].payload)["boot"] == 5  # never a repeated boot number

        def disk_full_said() -> bool:
            docs = [json.loads(m.payload) for m in sub.on(PREFIX + "health")]
            return any(d["serving"] and any("disk full" in w for w in d["selftest"].get("warnings", []))
                       for d in docs)

        assert sub.wait(disk_full_said, 30), [m.payload[:500] for m in sub.on(PREFIX + "health")][-1:]
        assert agent.stop() == 0
    finally:
        agent.kill()
        sub.close()
        broker.stop()
        shutil.rmtree(scratch, ignore_errors=True)
