"""The seed's trust model: the bundle the operator installed (config `bundle`) is trusted as installed and
recorded in the store with its manifest hash, so `rollback` to it works though it carries no signature,
and a seed changed on disk afterwards is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent.bundle.archive import pack
from agent.bundle.signing import keygen, sign_bundle
from agent.link.push import push
from agent.testing import rewrite_manifest
from agentproc import DEMO_BUNDLE, demo_config
from brokers import MOSQUITTO, Broker, Collector

DEVICE = "dev-seed"
PREFIX = f"edge/{DEVICE}/"

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists(), reason="mosquitto is not installed")


def test_rollback_to_the_unsigned_seeded_bundle_works_after_one_pushed_update(tmp_path: Path, agent_process) -> None:
    keygen(tmp_path / "k.pem", tmp_path / "k.pub")
    # budgets no load reaches, on both bundles: the demo's 50 ms p95 failed a 10-result probation at load 12
    # (56 ms) -- v2's after the push, and the seed's again after the rollback -- and this test, which is about
    # trust and rollback, not latency, saw rolled_back instead of committed
    seed = tmp_path / "seed"
    shutil.copytree(DEMO_BUNDLE, seed)  # unsigned, as the demo ships
    rewrite_manifest(seed, lambda m: m["selftest"].update(latency_budget_ms={"default": 1000.0}))
    v2 = tmp_path / "v2"
    shutil.copytree(seed, v2)
    rewrite_manifest(v2, lambda m: m.update(version=2))
    sign_bundle(v2, tmp_path / "k.pem")
    archive = pack(v2, tmp_path / "v2.tar.gz")

    broker = Broker(tmp_path / "broker").start()
    cfg = demo_config(tmp_path, port=broker.port, device_id=DEVICE, bundle=str(seed), source={"max_fps": 30},
                      output={"stdout": False},
                      updates={"enabled": True, "trusted_keys": [str(tmp_path / "k.pub")], "probation_s": 5.0,
                               "probation_frames": 10})
    col = Collector(broker.port, [PREFIX + "#"])
    agent = agent_process(cfg).start()
    try:
        assert col.wait(lambda: col.on(PREFIX + "predictions"), 90), agent.log_text()[-2000:]
        result = push(archive, DEVICE, "127.0.0.1", broker.port, timeout_s=120)
        assert result["state"] == "committed", result
        col.c.publish(PREFIX + "cmd/rollback", b'{"id": "back"}', qos=1)
        assert col.wait(lambda: col.on(PREFIX + "cmd/rollback/reply"), 120)
        reply = json.loads(col.on(PREFIX + "cmd/rollback/reply")[0].payload)
        assert reply["ok"] is True and reply["update"]["state"] == "committed", json.dumps(reply)
        n = len(col.on(PREFIX + "predictions"))
        # the reply goes out directly, predictions through the outbox: v2 results produced before the
        # rollback may still arrive after it, so wait for v1 to be what serves (never: it did not roll back)
        version = lambda: json.loads(col.on(PREFIX + "predictions")[-1].payload)["bundle"]["version"]  # noqa: E731
        assert col.wait(lambda: len(col.on(PREFIX + "predictions")) > n + 3 and version() == 1, 30), version()
        seeds = json.loads((tmp_path / "state" / "store" / "seeds.json").read_text())
        assert len(seeds) == 1 and next(iter(seeds)).startswith("digits-classifier-v1-")
    finally:
        agent.stop()
        col.close()
        broker.stop()
