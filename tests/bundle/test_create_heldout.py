"""`bundle create --heldout` judges every variant against what the author gave for the held-out set: the
package's own answers (`answers.json` beside the frames) and the source framework's `reference.<output>` arrays
(an npz). Before, both were read and ignored: the held-out set was judged against the FP32 built here, so FP32's
held-out figures read 1.0 by construction, whatever the package answered."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from stage_graphs import demo_answers, demo_graph_bundle

from agent.bundle.load import load_bundle
from agent.errors import BundleError, QualityError
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving.engine import build_engine
from agent.vocabulary.preprocess import read_image_file
from agentproc import DEMO_BUNDLE, DEMO_FRAMES

FP32 = Candidate(CPU, "fp32", "fp32")
FRAMES = sorted(DEMO_FRAMES.glob("*.png"))


def _create(tmp: Path, heldout: Path, keep: bool = False) -> Path:
    return demo_graph_bundle(tmp, heldout=heldout, keep_low_quality=keep)


def test_held_out_answers_that_agree_are_recorded_as_the_variants_agreement_with_the_package(tmp_path: Path) -> None:
    held = demo_answers(FRAMES[8:24], tmp_path / "held")
    root = _create(tmp_path, held)
    q = yaml.safe_load((root / "bundle.yaml").read_text())["variants"][0]["quality"]
    assert q["heldout_package_top1_agreement"] == 1.0, q


def test_held_out_answers_the_fp32_does_not_reproduce_refuse_the_bundle_naming_the_held_out_stage(tmp_path: Path) -> None:
    held = demo_answers(FRAMES[8:24], tmp_path / "held", wrong=4)  # 12 of 16 agree
    with pytest.raises(QualityError) as e:
        _create(tmp_path, held)
    assert "variant fp32" in str(e.value) and "build held-out vs package" in str(e.value), str(e.value)


def test_held_out_source_references_judge_the_variants_not_the_fp32_built_here(tmp_path: Path) -> None:
    """An npz held-out set with the source's `reference.logits`: judged against them (here the source's logits
    favour another class on 4 of 16 samples, as a different framework build would)."""
    engine = build_engine(load_bundle(DEMO_BUNDLE), FP32, SessionSettings())
    m = engine.bundle.manifest
    raw = np.stack([read_image_file(str(p), m.frame) for p in FRAMES[8:24]])
    logits = np.stack([engine.run(engine.preprocessor(r))["logits"][0] for r in raw])
    shifted = logits.copy()
    shifted[:4] = np.roll(shifted[:4], 1, axis=1)  # the source's top class is another one on 4 samples
    np.savez(tmp_path / "held.npz", raw=raw, **{"reference.logits": shifted})
    root = _create(tmp_path, tmp_path / "held.npz", keep=True)
    v = yaml.safe_load((root / "bundle.yaml").read_text())["variants"][0]
    assert "build held-out vs source" in v.get("below_floor", ""), v


def test_held_out_answers_of_another_kind_than_the_bundle_serves_are_refused_naming_the_kind(tmp_path: Path) -> None:
    """The golden answers' kind was checked against the kind the bundle serves; the held-out answers' was not:
    a `boxes` answers.json on a classifier was found only after every variant was built, each variant refused
    for "served result readable as boxes" (the author's file blamed on the variants; --keep-low-quality then
    kept a bundle with every variant below floor). Now refused before quantising, naming the file and kinds."""
    held = demo_answers(FRAMES[8:12], tmp_path / "held")
    doc = json.loads((held / "answers.json").read_text())
    doc["kind"] = "boxes"
    doc["results"] = [{"type": "boxes", "boxes": [], "scores": [], "class_ids": []} for _ in doc["results"]]
    (held / "answers.json").write_text(json.dumps(doc))
    with pytest.raises(BundleError) as e:
        _create(tmp_path, held)
    assert "answers are of kind 'boxes'" in str(e.value) and "serves kind 'classes'" in str(e.value), str(e.value)
    assert str(held) in str(e.value)


def test_held_out_source_references_the_post_stage_refuses_are_the_authors_refused_naming_set_and_sample(
        tmp_path: Path) -> None:
    """A `reference.logits` row with a NaN (the source framework's output on one held-out sample) made the post
    graph's probabilities non-finite: create_bundle ended on a bare StageOutputError 'stage post ... not finite'
    that named neither the held-out set, nor the sample, nor that the author's references (not a variant) broke."""
    engine = build_engine(load_bundle(DEMO_BUNDLE), FP32, SessionSettings())
    m = engine.bundle.manifest
    raw = np.stack([read_image_file(str(p), m.frame) for p in sorted(DEMO_FRAMES.glob("*.png"))[8:14]])
    logits = np.stack([engine.run(engine.preprocessor(r))["logits"][0] for r in raw])
    logits[2, 3] = np.nan
    np.savez(tmp_path / "held.npz", raw=raw, **{"reference.logits": logits})
    with pytest.raises(BundleError) as e:
        _create(tmp_path, tmp_path / "held.npz", keep=True)
    text = str(e.value)
    assert "build held-out vs source" in text and "sample 2" in text and "reference" in text, text
    assert "not finite" in text, text


def test_the_below_floor_text_names_every_stage_before_a_long_list_of_one_stage() -> None:
    """The held-out set adds a stage's findings (vs source, vs package) before the frame-size findings, and the
    below_floor text is cut at its length: the first finding of each stage comes first (the PicoDet INT8's text
    lost its frame-size findings this way)."""
    from agent.bundle.variant_judges import BELOW_FLOOR_CHARS, _each_stage_first

    golden = [f"fidelity: m{i} = 0.1 under bound 0.9 on sample {i} at stage build golden ({'x' * 300})" for i in range(20)]
    sizes = ["fidelity: m = 0.2 over bound 0.02 on sample 0 at stage build frame size 360x480 vs fp32",
             "fidelity: median IoU = 0.84 under bound 0.85 on sample 0 at stage build frame size 960x1280 vs fp32"]
    text = "; ".join(_each_stage_first(golden + sizes))[:BELOW_FLOOR_CHARS]
    assert "frame size 360x480" in text and "frame size 960x1280" in text
    assert text.startswith(golden[0])
