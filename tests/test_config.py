"""A bad config names the file and the key; a good one yields typed settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import load_config
from agent.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return p


def test_valid_config_is_typed_and_relative_paths_anchor_to_the_file(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, """
device_id: cam-7
state_dir: state
bundle: models/b
providers:
  order: [OpenVINOExecutionProvider, CPUExecutionProvider]
  options: {OpenVINOExecutionProvider: {device_type: CPU}}
selection: {allow_cpu_fallback: false, prefer_margin: 0.2}
session: {intra_op_threads: 2, graph_optimization: extended}
"""))
    assert cfg.device_id == "cam-7"
    assert cfg.state_dir == tmp_path / "state" and cfg.bundle == tmp_path / "models" / "b"
    assert cfg.providers.options["OpenVINOExecutionProvider"]["device_type"] == "CPU"
    assert cfg.selection.allow_cpu_fallback is False and cfg.session.intra_op_threads == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("selection: {allow_cpu_falback: false}", r"agent\.yaml: key selection\.allow_cpu_falback: unknown key"),
        ("session: {intra_op_threads: two}", r"key session\.intra_op_threads: expected an integer, found 'two'"),
        ("session: {graph_optimization: max}", r"key session\.graph_optimization: expected one of"),
        ("selection: {allow_cpu_fallback: 'no'}", r"key selection\.allow_cpu_fallback: expected true or false"),
        ("providers: {order: CPUExecutionProvider}", r"key providers\.order: expected a list"),
        ("- just\n- a list", "expected a mapping at the top level"),
        ("a: [", "malformed YAML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read config"):
        load_config(tmp_path / "nope.yaml")
