"""The package's own answers: read from answers.json beside a sample directory's frames or key `answers`
of an .npz; every error names the file, the sample index and the field; the count must match the samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import answers


def _doc(n: int = 3, **over: Any) -> dict[str, Any]:
    results = [{"type": "boxes", "boxes": [{"box": [i, i, i + 10, i + 10], "score": 0.9, "class_id": 0}]}
               for i in range(n)]
    return {"kind": "boxes", "package": "yolox 0.3.0", "produced_by": "scripts/yolox_answers.py", "results": results,
            **over}


def test_directory_answers_json_is_read_and_found_beside_the_frames(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"")
    assert not answers.has_answers(tmp_path)
    (tmp_path / "answers.json").write_text(json.dumps(_doc()))
    assert answers.has_answers(tmp_path)
    a = answers.read_answers(tmp_path, 3)
    assert a.kind == "boxes" and a.package == "yolox 0.3.0" and len(a.results) == 3
    assert a.source == str(tmp_path / "answers.json")
    assert json.loads(a.to_json()) == _doc()


def test_npz_key_answers_is_read(tmp_path: Path) -> None:
    p = tmp_path / "golden.npz"
    np.savez(p, raw=np.zeros((3, 4, 4, 3), np.uint8), answers=np.array(json.dumps(_doc())))
    assert answers.has_answers(p)
    assert answers.read_answers(p, 3).results[2]["boxes"][0]["box"] == [2, 2, 12, 12]
    np.savez(p, raw=np.zeros((3, 4, 4, 3), np.uint8))
    assert not answers.has_answers(p)
    with pytest.raises(BundleError, match=r"golden.npz: no key 'answers'"):
        answers.read_answers(p, 3)


def test_count_must_match_the_samples(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="field results: 3 package answers for 4 samples"):
        answers.read_answers(_doc(), 4, "golden")
    with pytest.raises(BundleError, match="field results: 3 package answers for 2 samples"):
        answers.read_answers(_doc(), 2, "golden")
    assert len(answers.read_answers(_doc(), 2, "golden", truncate=True).results) == 2  # a --limit


def test_a_bad_result_names_file_sample_and_field(tmp_path: Path) -> None:
    doc = _doc()
    doc["results"][1]["boxes"][0]["score"] = "high"
    (tmp_path / "answers.json").write_text(json.dumps(doc))
    with pytest.raises(BundleError) as e:
        answers.read_answers(tmp_path, 3)
    assert str(e.value) == (f"{tmp_path / 'answers.json'}: sample 1: field boxes[0].score: a finite number wanted, "
                            "found 'high'")


def test_a_result_of_another_kind_is_refused_at_its_sample() -> None:
    doc = _doc()
    doc["results"][2] = {"type": "classes", "top": [{"class_id": 0, "score": 1.0}]}
    with pytest.raises(BundleError, match=r"golden: sample 2: field type: 'classes' is not a result this kind reads"):
        answers.read_answers(doc, 3, "golden")


def test_document_fields_are_checked_by_name() -> None:
    with pytest.raises(BundleError, match="field kind: unknown result kind 'detections'"):
        answers.read_answers(_doc(kind="detections"), 3, "g")
    with pytest.raises(BundleError, match="field produced_by: a non-empty string wanted"):
        answers.read_answers(_doc(produced_by=""), 3, "g")
    doc = _doc()
    del doc["package"]
    with pytest.raises(BundleError, match="field package: missing"):
        answers.read_answers(doc, 3, "g")
    with pytest.raises(BundleError, match="field result: not a field of package answers"):
        answers.read_answers(_doc(result=[]), 3, "g")


def test_non_strict_json_is_refused_with_the_file(tmp_path: Path) -> None:
    p = tmp_path / "answers.json"
    p.write_text(json.dumps(_doc()).replace("0.9", "NaN", 1))
    with pytest.raises(BundleError, match=r"answers.json: the package's answers are not strict JSON: NaN"):
        answers.read_answers(p, 3)
    p.write_text("{")
    with pytest.raises(BundleError, match="not strict JSON"):
        answers.read_answers(p, 3)


def test_vocabulary_results_are_valid_answers_and_judged_by_their_kind() -> None:
    doc = {"kind": "classes", "package": "torchvision 0.20", "produced_by": "hub script",
           "results": [{"type": "classification", "top": [{"class_id": 3, "label": "cat", "score": 0.7}]}]}
    a = answers.read_answers(doc, 1, "golden")
    served = [{"type": "classes", "top": [{"class_id": 3, "label": "cat", "score": 0.64}]}]
    figures, findings = answers.judge(a, served)
    assert figures["max_score_diff"] == pytest.approx(0.06) and findings[0].sample == 0
    assert answers.golden_warnings(a) == []  # one sample only: no claim about the set's classes
