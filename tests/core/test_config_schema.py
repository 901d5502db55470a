"""The config is checked by one JSON Schema made from the settings dataclasses: every key documented,
each default defined once, ranges on the fields, source keys by source type, errors naming file and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent.config import Config, SelectionConfig, load_config
from agent.config_schema import config_schema, dataclass_schema, field_hints, key_of
from agent.errors import ConfigError
from agent.proof.selection import SelectionPolicy


def _load(tmp_path: Path, text: str) -> Config:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return load_config(p)


def _settings_classes() -> list[type]:
    seen: list[type] = []

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for hint in field_hints(cls).values():
            for arg in [hint, *getattr(hint, "__args__", ())]:
                for inner in [arg, *getattr(arg, "__args__", ())]:
                    if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                        walk(inner)

    walk(Config)
    return seen


def test_every_config_key_is_documented_in_the_schema() -> None:
    undocumented = [f"{cls.__name__}.{f.name}" for cls in _settings_classes() for f in dataclasses.fields(cls)
                    if f.init and f.name != "source_file" and not dataclasses.is_dataclass(f.type)
                    and not key_of(field_hints(cls)[f.name]).doc
                    and not dataclasses.is_dataclass(field_hints(cls)[f.name])]
    assert not undocumented, f"keys without a Key(doc=...): {undocumented}"
    assert config_schema()["additionalProperties"] is False


def test_the_selection_defaults_are_defined_once_by_the_proofs_policy() -> None:
    shared = [f.name for f in dataclasses.fields(SelectionPolicy)]
    assert {n: getattr(SelectionConfig(), n) for n in shared} == {n: getattr(SelectionPolicy(), n) for n in shared}
    text = Path(__file__).resolve().parents[2].joinpath("agent", "proof", "selftest.py").read_text()
    assert 'getattr(sel, "latency_retries"' not in text  # the third copy of the defaults


def test_a_typod_key_says_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"agent\.yaml: key selection\.allow_cpu_falback: unknown key; "
                                          r"did you mean 'selection\.allow_cpu_fallback'\?"):
        _load(tmp_path, "selection: {allow_cpu_falback: false}")


@pytest.mark.parametrize("text, message", [
    ("source: {type: udp, url: 'rtsp://x'}", r"key source\.url: not used by a 'udp' source"),
    ("source: {path: frames, url: 'rtsp://x'}", r"key source\.url: not used by a 'folder' source"),
    ("sources: [{name: a, type: folder, path: p, port: 5}]", r"key sources\[0\]\.port: not used by a 'folder'"),
])
def test_a_key_the_source_type_does_not_read_is_refused_naming_it(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)


def test_keys_each_source_type_reads_are_accepted(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "sources:\n  - {name: a, type: udp, port: 9000, hop: 32}\n"
                          "  - {name: b, type: stream, url: 'rtsp://127.0.0.1/x', decoder_threads: 2}\n")
    assert cfg.sources[0].port == 9000 and cfg.sources[1].decoder_threads == 2


@pytest.mark.parametrize("device_id", ["a/b", "a+b", "#", "x" * 65, "has space"])
def test_a_device_id_that_is_not_one_topic_level_is_refused(tmp_path: Path, device_id: str) -> None:
    with pytest.raises(ConfigError, match=r"key device_id: .* is not allowed here"):
        _load(tmp_path, f"device_id: {device_id!r}")


def test_a_number_where_text_is_expected_is_read_as_text(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "device_id: 7\nsource: {type: camera, device: 0}")
    assert cfg.device_id == "7" and cfg.source.device == "0"


def test_ranges_live_on_the_fields() -> None:
    props = dataclass_schema(Config)["properties"]
    assert props["pipeline"]["properties"]["max_batch"]["minimum"] == 1
    assert props["mqtt"]["properties"]["port"]["maximum"] == 65535
