"""One place for each fact: the reference tables in docs/reference/ are generated from the code that
defines the facts (scripts/gen_docs.py), and a stale one fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_docs_are_current() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_every_config_key_and_topic_is_in_the_generated_reference() -> None:
    from agent.config import Config
    from agent.link.topics import Topics

    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_docs

    config = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert all(f"| `{k}` |" in config for k, *_ in gen_docs.config_rows(Config))
    assert "| `pipeline.max_batch` | int | `1` | >= 1 |" in config  # type, default and range, not only the name
    topics = (ROOT / "docs" / "reference" / "topics.md").read_text()
    assert all(f"`{t}`" in topics for t in Topics.documented())


def test_a_stale_generated_table_is_caught(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "docs" / "reference", copy)
    (copy / "topics.md").write_text((copy / "topics.md").read_text().replace("availability", "availabilty", 1))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check", "--dir", str(copy)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "topics.md" in r.stderr and "config.md" not in r.stderr


# -- docs that hold as written (issue 45) ---------------------------------------------------------------------
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    """Fault: four links were written relative to the repository root from inside docs/ (observability.md's
    screenshot, the scrape and dashboard examples) or to a path that is not there (bundles.md's schema)."""
    broken = []
    for md in DOCS:
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not (md.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _shown_commands() -> list[tuple[str, str]]:
    """(file, command) for every `edge-agent ...` a person is shown: in code blocks (a line continued with a
    backslash joined), and in inline code."""
    out = []
    for md in DOCS:
        text = md.read_text()
        for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith("edge-agent "):
                    out.append((md.name, line))
        for inline in re.findall(r"`(edge-agent [^`]+)`", text):
            out.append((md.name, inline))
    return out


def _subparsers(p: Any) -> dict[str, Any]:
    import argparse

    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def test_every_edge_agent_command_shown_in_readme_and_docs_parses() -> None:
    """Each command's words name a real command (its `--help` works), each `--flag` shown is one of its options,
    and a command shown with arguments shows every required option (README's `bundle keygen [--force]` did not:
    it needs --private and --public)."""
    import contextlib
    import io

    from agent.service.cli import build_parser

    root = build_parser()
    global_flags = {s for a in root._actions for s in a.option_strings}
    problems = []
    shown = _shown_commands()
    assert len(shown) > 40  # the extraction found the docs' commands
    for where, cmd in shown:
        words = cmd.replace("[", " ").replace("]", " ").replace("|", " ").split()[1:]
        parser, path, rest = root, [], []
        for i, w in enumerate(words):
            subs = _subparsers(parser)
            if w in subs:
                parser = subs[w]
                path.append(w)
            elif w in global_flags and not path:
                continue
            else:
                rest = words[i:]
                break
        if not path:
            problems.append(f"{where}: {cmd!r}: no command")
            continue
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            parser.parse_args(["--help"])  # what `edge-agent <command> --help` prints
        known = {s for a in parser._actions for s in a.option_strings}
        flags = [w.split("=")[0] for w in rest if w.startswith("--")]
        problems += [f"{where}: {cmd!r}: {f} is not an option of `edge-agent {' '.join(path)}`"
                     for f in flags if f not in known]
        if rest and not _subparsers(parser):
            for a in parser._actions:
                if a.required and a.option_strings and not any(s in rest for s in a.option_strings):
                    problems.append(f"{where}: {cmd!r}: lacks the required {a.option_strings[0]}")
    assert not problems, "\n".join(problems)


def test_every_example_config_passes_config_check_or_is_refused_for_a_documented_reason() -> None:
    """Fault: examples/camera.yaml named state_dir /var/lib/edge-agent, against the README's rule that only the
    service's config names it. A camera example is refused only where its node is absent, as its comment says."""
    import contextlib
    import io

    from agent.service.cli import main

    for cfg in sorted((ROOT / "examples").glob("*.yaml")):
        text = cfg.read_text()
        assert (yaml.safe_load(text) or {}).get("state_dir") != "/var/lib/edge-agent", \
            f"{cfg.name} names the service's state dir, which only the service's config may"
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["--log-level", "error", "config", "check", str(cfg)])
        if code != 0 and "key source.device: /dev/video" in err.getvalue() and "config check` refuses" in text:
            continue  # no camera on this machine: the refusal the example's own comment documents
        assert code == 0, f"{cfg.name}: {err.getvalue()}"
