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


# -- ranges, masking, bounded JSON (issue 12) ----------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("pipeline: {inference_workers: -3}", r"key pipeline\.inference_workers: expected >= 0, found -3"),
    ("updates: {keep: 0}", r"key updates\.keep: expected >= 1, found 0"),
    ("mqtt: {port: 70000}", r"key mqtt\.port: expected <= 65535"),
    ("pipeline: {queue_size: 0}", r"key pipeline\.queue_size: expected >= 1"),
    ("updates: {min_chunk_bytes: 9000, max_chunk_bytes: 4096}", r"updates\.min_chunk_bytes: 9000 is over"),
])
def test_values_that_parse_but_cannot_work_are_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_masked_settings_hide_the_password_only() -> None:
    from agent.config import Config, MqttConfig, config_to_dict, masked

    doc = masked(config_to_dict(Config(mqtt=MqttConfig(username="u", password="hunter2"))))
    assert doc["mqtt"]["password"] == "***" and doc["mqtt"]["username"] == "u"
    assert masked(config_to_dict(Config()))["mqtt"]["password"] is None


def test_state_dir_defaults_to_the_users_xdg_state_home_not_the_services(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    from agent.config import Config

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert Config().state_dir == tmp_path / "edge-agent"


@pytest.mark.parametrize("payload, message", [
    (b"[" * 60_000, "nested deeper than 32"),
    (b'{"a": "' + b"[" * 100 + b'"}', None),  # brackets inside strings do not count
    (b"x" * 70_000, "over the 65536 byte limit"),
    (b"\xff\xfe", "not JSON"),
    (b"[1]", "must be a JSON object"),
    (b"1" * 5000, "not JSON"),  # Python refuses int strings over 4300 digits: an error, not a hang
])
def test_bounded_json_parsing(payload: bytes, message: str | None) -> None:
    from agent.config import PayloadError, parse_json_object

    if message is None:
        assert parse_json_object(payload, 65536) == {"a": "[" * 100}
    else:
        with pytest.raises(PayloadError, match=message):
            parse_json_object(payload, 65536)


def test_a_retired_key_says_what_replaced_it(tmp_path: Path) -> None:
    """mqtt.max_running_commands did nothing once the controller queued every command: a config that still
    sets it is told so and what to do, not merely 'unknown key'."""
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "mqtt:\n  max_running_commands: 4\n"))
    msg = str(err.value)
    assert "key mqtt.max_running_commands: removed" in msg and "delete the line" in msg
