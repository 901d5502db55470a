"""The distribution is ours and every install hint works from a checkout (issue 18): `edge-agent` on the public
package index is another project, so `pip install 'edge-agent[...]'` would install it. Examples write no fixed
/tmp path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.errors import install_hint

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_name_is_ours_and_the_console_script_stays_edge_agent() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "edge-agent-onnx"
    assert project["scripts"] == {"edge-agent": "agent.service.cli:main"}
    # install.sh finds the wheel pip builds for that name (pip normalises - to _ in wheel file names)
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "edge_agent_onnx-*.whl" in install and "--upgrade edge-agent-onnx" in install


def test_no_hint_in_the_code_or_the_examples_names_the_unrelated_package() -> None:
    wrong = []
    for path in [*(ROOT / "agent").rglob("*.py"), *(ROOT / "examples").iterdir(), *(ROOT / "systemd").iterdir()]:
        if path.is_file():
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"pip install [\"']?edge-agent\b", line):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_every_hinted_extra_exists_in_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    hinted = set()
    for path in (ROOT / "agent").rglob("*.py"):
        hinted |= set(re.findall(r"install_hint\(\"(\w+)\"", path.read_text()))
    assert hinted and hinted <= set(extras), hinted - set(extras)
    assert install_hint("metrics", "prometheus-client") == (
        "pip install '.[metrics]' from an edge-agent checkout (or pip install prometheus-client)")


def test_the_shipped_examples_write_no_fixed_tmp_path() -> None:
    import yaml

    for path in (ROOT / "examples").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text()) or {}
        if isinstance(doc, dict):
            assert not str(doc.get("state_dir", "")).startswith("/tmp"), path
