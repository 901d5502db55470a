"""The tree shows the architecture: packages by concern, lower ones never importing higher ones,
and the pure core never importing onnxruntime or a shell module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"

# Foundation modules (errors, fsio, hashing, logsetup, npio, quantiles) sit under everything; `testing` and
# `__main__` over everything. Packages on one floor (serving, link, updates) do not import each other.
FLOOR = {
    "__init__": 0, "errors": 0, "fsio": 0, "hashing": 0, "logsetup": 0, "keydoc": 0, "npio": 0, "quantiles": 0,
    "vocabulary": 1, "bundle": 2, "proof": 3, "results": 3, "config": 4, "config_schema": 4, "source_types": 4,
    "serving": 5, "link": 5, "updates": 5,
    "report": 6, "service": 6, "fleet": 6, "testing": 7, "__main__": 7,
}
# The upward arrows: `bundle create` measures each variant it builds through the proof's sessions
# ... and judges the package's answers by their result kind (issue 21); its model build's steps
# (bundle/model_build.py) and the modules they call (the spec, the runs, the variants' judges) are part of the same
# command.
ALLOWED_UP = {("bundle/model_build.py", "proof"), ("bundle/build_spec.py", "proof"), ("bundle/build_runs.py", "proof"),
              ("bundle/variant_judges.py", "proof"), ("bundle/variant_judges.py", "results")}
PURE = [
    "agent.vocabulary.manifest", "agent.vocabulary.preprocess", "agent.vocabulary.decoders",
    "agent.proof.terms", "agent.proof.parity", "agent.proof.agreement", "agent.proof.verdict", "agent.proof.selection", "agent.proof.pre_compare",
    "agent.proof.isa", "agent.config",
    "agent.config_schema", "agent.source_types", "agent.results", "agent.results.answers",
]


TESTS = AGENT.parent / "tests"
# tests/<package>/test_<module>.py mirror agent/ (docs/testing.md); the folders of tests/ that are no package of
# agent/, each for what has no one package: agent's top-level modules (config, fsio, npio, quantiles, ...), the
# agent end to end as deployed, the project itself; and the suite's data.
TEST_FOLDERS_BESIDE_PACKAGES = {"core", "e2e", "project", "fixtures", "aedes"}


def _agent_imports(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "agent":
            out += [f"agent.{a.name}" for a in node.names] if node.module == "agent" else [node.module]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "agent"]
    return out


def test_every_module_belongs_to_a_known_floor_and_every_package_says_what_it_owns():
    for path in AGENT.rglob("*.py"):
        top = path.relative_to(AGENT).parts[0].removesuffix(".py")
        assert top in FLOOR, f"{path}: not in the layout; add it to a package by concern"
    for pkg in (p for p in AGENT.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and len(doc) > 20, f"{pkg}/__init__.py must say what the package owns"


def test_no_package_imports_a_higher_or_sibling_floor():
    wrong = []
    for path in AGENT.rglob("*.py"):
        rel = path.relative_to(AGENT)
        me = rel.parts[0].removesuffix(".py")
        for mod in _agent_imports(path):
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 and parts[1] in FLOOR else "__init__"
            upward = FLOOR[target] > FLOOR[me]
            sideways = FLOOR[target] == FLOOR[me] == 5 and target != me
            if (upward or sideways) and (rel.as_posix(), target) not in ALLOWED_UP:
                wrong.append(f"{rel}: imports {mod}")
    assert not wrong, "\n".join(wrong)


def test_pure_core_imports_no_onnxruntime_no_broker_client_and_no_shell_module():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + "bad = [m for m in ('onnxruntime', 'paho', 'sqlite3', 'agent.proof.session', 'agent.proof.probe') if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=AGENT.parent).stdout.strip()
    assert out == "", f"the pure core pulled in: {out}"


def test_tests_mirror_the_package_and_no_test_file_is_left_flat() -> None:
    """Issue 46 item 6: a test lives in the folder of the package it tests (tests/serving/ for agent/serving/), its
    faults named for the behaviour they pin, not the review that found them; tests/ itself holds only the
    helper modules every folder imports (agentproc, brokers, waiting, ...) and conftest.py."""
    packages = {p.name for p in AGENT.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    assert folders - packages - TEST_FOLDERS_BESIDE_PACKAGES == set(), "a tests/ folder that names no agent/ package"
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == [], "test files left flat in tests/"
    test_files = [p for p in TESTS.glob("*/test_*.py")]
    for folder in folders - {"fixtures", "aedes"}:
        assert (TESTS / folder / "__init__.py").is_file(), f"tests/{folder}/ is not a package"
        assert sorted(p.name for p in (TESTS / folder).glob("*.py") if not p.name.startswith("test_")) == ["__init__.py"], (
            f"tests/{folder}/ holds a helper: helpers live in tests/ itself")
    assert list(TESTS.glob("*/*/test_*.py")) == [], "one folder deep: tests/<package>/test_<module>.py"
    names = [p.name for p in test_files]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "one basename, one test file"
    assert [p.name for p in test_files if "review" in p.stem] == [], "named for a review, not a behaviour"
