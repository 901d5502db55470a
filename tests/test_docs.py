"""One place for each fact: the reference tables in docs/reference/ are generated from the code that
defines the facts (scripts/gen_docs.py), and a stale one fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
