"""device_id is a topic level and the broker account's %u: `config check` refuses ids that would split the
topic or match other devices (fault, issue 20: `a/b`, `a+b` and `#` were accepted; with `+`, the command
subscription matched every device's commands)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("device_id", ["a+b", "a/b", "#", "", "x" * 65, "a b", "tab\there"])
def test_a_device_id_that_is_not_one_topic_level_is_refused_naming_the_key(tmp_path: Path, device_id: str) -> None:
    from agent.config import load_config
    from agent.errors import ConfigError

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"device_id": device_id}))
    with pytest.raises(ConfigError, match="key device_id"):
        load_config(tmp_path / "c.yaml")


def test_config_check_refuses_a_device_id_that_is_not_one_topic_level(tmp_path: Path) -> None:
    # the command line, once (each id above in its own process cost a second of imports apiece)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"device_id": "a+b"}))
    r = subprocess.run([sys.executable, "-m", "agent", "config", "check", str(tmp_path / "c.yaml")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "key device_id" in r.stderr, (r.returncode, r.stderr)


@pytest.mark.parametrize("device_id", ["dev-a", "cam_01.site-3", "x" * 64])
def test_config_check_accepts_plain_device_ids(tmp_path: Path, device_id: str) -> None:
    from agent.config import load_config

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"device_id": device_id}))
    assert load_config(tmp_path / "c.yaml").device_id == device_id
