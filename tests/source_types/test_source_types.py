"""Typed sources: one config class per type behind a registry, and capabilities read through Protocols.

A throwaway source type (tests/throwaway_source.py: its config class and its opener, one module) registered
from here and nowhere else is taken by config parsing, `config check`, the generated schema and docs, and the
pipeline serving the real demo bundle. The pipeline and health read no source member through getattr or
hasattr, and no module outside agent/source_types spells a group of source types as a list of names.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from agent.config import PipelineConfig, SourceConfig, parse_config
from agent.config_schema import config_schema
from agent.errors import ConfigError
from agent.source_types import FolderSourceConfig, UdpSourceConfig, registered
from throwaway_source import TickSource, TickSourceConfig

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"
DEMO = ROOT / "models" / "digits-classifier"
DIGITS = ROOT / "models" / "demo-frames" / "digits"


@pytest.fixture
def tick() -> Iterator[type[TickSourceConfig]]:
    from agent.serving.sources import register_source, unregister_source

    register_source(TickSourceConfig, TickSource)  # the one registration: nothing else names the type
    try:
        yield TickSourceConfig
    finally:
        unregister_source("tick")


def _config(tmp_path: Path, source: dict) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO), "source": source}))
    return p


def test_a_throwaway_type_is_parsed_into_its_own_class_with_its_keys(tick, tmp_path: Path) -> None:
    cfg = parse_config(yaml.safe_dump({"source": {"type": "tick", "pictures": str(DIGITS), "frames": 5}}),
                       str(tmp_path / "agent.yaml"))
    assert type(cfg.source) is TickSourceConfig and (cfg.source.frames, cfg.source.pictures) == (5, DIGITS)
    assert SourceConfig(type="tick", frames=2) == TickSourceConfig(frames=2)  # the union's constructor


@pytest.mark.parametrize("source, message", [
    ({"type": "tick", "frames": 0}, "key source.frames: expected >= 1, found 0"),
    ({"type": "tick", "url": "rtsp://x"}, "key source.url: not used by a 'tick' source (read by: stream); "
                                         "remove it or change the type"),
    ({"type": "folder", "frames": 3}, "key source.frames: not used by a 'folder' source (read by: tick); "
                                      "remove it or change the type"),
    ({"type": "tick", "framez": 3}, "key source.framez: unknown key; did you mean 'source.frames'?"),
])
def test_a_throwaway_types_bad_keys_are_refused_naming_the_key(tick, source: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"agent.yaml: {message}")):
        parse_config(yaml.safe_dump({"source": source}), "agent.yaml")


def test_without_its_registration_the_type_is_unknown() -> None:
    with pytest.raises(ConfigError, match=re.escape("key source.type: expected one of ['folder', 'video'")):
        parse_config(yaml.safe_dump({"source": {"type": "tick"}}), "agent.yaml")
    assert "tick" not in config_schema()["properties"]["source"]["properties"]["type"]["enum"]


def test_a_throwaway_type_is_in_the_generated_schema_and_reference(tick) -> None:
    source = config_schema()["properties"]["source"]
    assert source["properties"]["type"]["enum"][-1] == "tick"
    assert source["properties"]["frames"] == {"type": "integer", "minimum": 1,
                                              "description": "tick: how many frames before the source ends"}
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_docs
    from agent.config import Config

    rows = {k: (t, d, r, doc) for k, t, d, r, doc in gen_docs.config_rows(Config)}
    assert rows["source.frames"] == ("int", "`3`", ">= 1", "tick: how many frames before the source ends "
                                                         "(source types: tick)")
    assert "`tick`" in rows["source.type"][0] and "tick (a test's frames)" in rows["source.type"][3]


def test_config_check_takes_a_throwaway_type(tick, tmp_path: Path, capsys) -> None:
    from agent.service.cli import main

    assert main(["config", "check", str(_config(tmp_path, {"type": "tick", "pictures": str(DIGITS)}))]) == 0
    out = capsys.readouterr()
    src = json.loads(out.out)["source"]  # the effective settings: the type's own keys, its defaults filled in
    assert (src["type"], src["pictures"], src["frames"], src["stall_timeout_s"]) == ("tick", str(DIGITS), 3, 5.0)
    assert "agent.yaml: OK" in out.err


def test_the_pipeline_serves_a_throwaway_type_with_the_real_bundle(tick) -> None:
    from agent.bundle.load import load_bundle
    from agent.proof.terms import SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.serving.sources import open_source
    from agent.testing import ListSink
    from pipelines import run_to_end

    b = load_bundle(DEMO)
    cfg = parse_config(yaml.safe_dump({"source": {"type": "tick", "pictures": str(DIGITS), "frames": 4}}),
                       "agent.yaml").source
    source = open_source(cfg, b.manifest.frame, b.manifest.preprocess.resize)
    assert isinstance(source, TickSource)
    sink = ListSink()
    engine = build_engine(b, Candidate("CPUExecutionProvider", "fp32", "fp32"), SessionSettings())
    run_to_end(source, engine, sink, PipelineConfig(), lossless=True)
    files = sorted(DIGITS.glob("*.png"))[:4]
    # the demo frames are named <n>-<digit>.png: the real model reads each one's digit
    assert [r["result"]["top"][0]["label"] for r in sink.results] == [f.stem.split("-")[1] for f in files]


def test_the_built_in_types_are_registered_each_from_its_own_module() -> None:
    assert list(registered()) == ["folder", "video", "camera", "stream", "udp", "file", "stdin", "mqtt"]
    for name, cls in registered().items():
        assert cls.__module__ == f"agent.source_types.{name}" and cls.TYPE == name
    assert type(SourceConfig()) is FolderSourceConfig and type(SourceConfig(type="udp")) is UdpSourceConfig


# -- what the pipeline and health read from a source -------------------------------------------------------
SOURCE_NAMES = re.compile(r"\b(source|src|feed|feeds|sources)\b")


def _agent_trees() -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(AGENT.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_no_source_member_is_read_through_getattr_or_hasattr() -> None:
    """A source's optional members are capabilities (agent/serving/capabilities.py), asked by isinstance."""
    found = []
    for path, tree in _agent_trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and SOURCE_NAMES.search(ast.unparse(node.args[0]))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_source_type_groups_are_declared_only_in_agent_source_types() -> None:
    """A group of types (camera-like, sensor, network...) is a key class the types compose, never a list of names."""
    names = set(registered())
    found = []
    for path, tree in _agent_trees():
        if path.parent.name == "source_types":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                spelled = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
                if len(spelled) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(spelled)}")
    assert not found, "\n".join(found)
