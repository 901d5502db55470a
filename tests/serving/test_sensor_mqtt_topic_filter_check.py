"""Review of issue 44 point 3 (third pass): "a source that cannot keep the contract is refused by `config check`
and at boot with one line". docs/sensors.md: "A topic filter (`+`, `#`) is refused: two publishers' samples would
mix in one window." The boot refuses it; `config check` says the config is fine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import SourceConfig
from agent.errors import ConfigError
from tests.serving.test_sensor_backlog import bundle  # noqa: F401 (the fixture)


def test_config_check_refuses_an_mqtt_samples_topic_filter_as_the_boot_does(bundle: Path, tmp_path: Path) -> None:  # noqa: F811
    from agent.bundle.load import load_bundle
    from agent.serving.sources import open_source

    topic = "site/+/mic"
    with pytest.raises(ConfigError, match=r"source\.topic: .* not a filter"):
        open_source(SourceConfig(type="mqtt", host="127.0.0.1", port=1, topic=topic, payload="samples",
                                 framing="seq32"), load_bundle(bundle).manifest.frame)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nbundle: {bundle}\n"
                   f"source: {{type: mqtt, host: 127.0.0.1, topic: '{topic}', payload: samples, framing: seq32}}\n")
    r = subprocess.run([sys.executable, "-m", "agent", "config", "check", str(cfg)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "source.topic" in out, f"config check rc {r.returncode}:\n{out[-1500:]}"
