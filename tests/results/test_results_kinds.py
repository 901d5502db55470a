"""The result kinds' registry: every kind module is registered and answers the same questions (check,
compact as strict JSON of its own type, normalise, fidelity against itself, golden warnings), a served
result the kind cannot read is a finding on its sample, and the package stays pure (no onnxruntime)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import agent.results
from agent.results import KINDS

ROOT = Path(__file__).resolve().parents[2]

EXAMPLES = {
    "classes": ({"probabilities": np.array([0.1, 0.7, 0.2], np.float32)}, {}),
    "boxes": ({"boxes": np.array([[10, 10, 60, 50], [0, 0, 5, 5]], np.float32),
               "scores": np.array([0.9, 0.4], np.float32), "class_ids": np.array([1, 0], np.int64),
               "keypoints": np.ones((2, 5, 3), np.float32)}, {}),
    "masks": ({"mask": np.pad(np.ones((4, 5), np.uint8), 3)}, {}),
    "text": ({"tokens": np.array([1, 0, 2, 3], np.int64), "token_scores": np.full(4, 0.9, np.float32)}, {}),
    "scores": ({"scores": np.array([0.2, 0.8], np.float32)}, {"threshold": 0.5}),
}
CHARSET = ("-", "a", "b", "c")


def test_every_kind_module_is_registered() -> None:
    found = []
    for info in pkgutil.iter_modules(agent.results.__path__):
        module = importlib.import_module(f"agent.results.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "FIELDS"):
            found.append(module.NAME)
    assert sorted(found) == sorted(KINDS) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_kind_checks_compacts_reads_back_and_agrees_with_itself(name: str) -> None:
    kind = KINDS[name]
    tensors, spec = EXAMPLES[name]
    assert kind.check(tensors, spec) == []
    result = kind.compact(tensors, spec, ("zero", "one"), CHARSET)
    assert result["type"] == name and name in kind.READS
    text = json.dumps(result, allow_nan=False)  # strict JSON, as served
    kind.normalise(json.loads(text))
    figures, findings = kind.fidelity([result, result], [result, result])
    assert findings == []
    json.dumps(figures, allow_nan=False)
    assert isinstance(kind.golden_warnings([result]), list)
    # a required field missing is named
    required = [f.name for f in kind.FIELDS if f.required]
    assert required and all(required[0] in p for p in kind.check({}, spec)[:1])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_served_result_the_kind_cannot_read_is_a_finding_on_its_sample(name: str) -> None:
    kind = KINDS[name]
    tensors, spec = EXAMPLES[name]
    good = kind.compact(tensors, spec, (), CHARSET)
    other = "masks" if name != "masks" else "boxes"
    wrong = KINDS[other].compact(*EXAMPLES[other], (), CHARSET)
    _, findings = kind.fidelity([good, wrong, good], [good, good, good])
    unreadable = [f for f in findings if f.metric == f"served result readable as {name}"]
    assert [f.sample for f in unreadable] == [1] and "is not a result this kind reads" in unreadable[0].detail
    _, findings = kind.fidelity([good], [good, good])
    assert findings[0].metric == f"{name} results paired with package answers"


def test_docs_name_every_kind_field_option_and_floor() -> None:
    doc = (ROOT / "docs" / "results.md").read_text()
    for name, kind in KINDS.items():
        assert f"`{name}`" in doc
        for key in [f.name for f in kind.FIELDS] + [o.key for o in kind.OPTIONS] + list(kind.DEFAULT_FLOORS):
            assert f"`{key}`" in doc, f"docs/results.md does not name {name}'s {key}"
        for key, value in kind.DEFAULT_FLOORS.items():
            assert f"`{key}` | {value:g}" in doc, f"docs/results.md does not give {name}'s default {key} = {value:g}"
    assert "(results.md)" in (ROOT / "docs" / "README.md").read_text()


def test_the_package_is_pure_numpy() -> None:
    code = "import sys, agent.results, agent.results.answers; print('onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
