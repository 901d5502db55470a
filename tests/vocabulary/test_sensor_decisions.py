"""Decisions and events of the raw decoder, judged against a real VAD package's own decisions and segments.

Issue 22: the raw decoder could not select a channel, threshold it, or publish decisions or segments;
`max_values` over its limit was reported as "unsupported type 'raw'"; argmax over one value made every
binary single-output model decide class 0; fidelity for raw was SNR over every channel even where the
bundle publishes a decision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sensor_streams import HOP, SR, Served, build_vad_bundle, package_run, speech
from waiting import wait_until

SEGMENTS = {"threshold": 0.5, "neg_threshold": 0.35, "min_speech_duration_ms": 250, "min_silence_duration_ms": 100}
VAD_DECISIONS = {"type": "raw", "outputs": ["output"], "max_values": 0,
                 "decision": {"rule": "threshold", "output": "output", "threshold": 0.5, "labels": ["silence", "speech"]},
                 "events": {"label": "speech", "off_threshold": 0.35, "min_duration_s": 0.25, "hangover_s": 0.1}}


@pytest.mark.slow
def test_vad_decisions_and_segments_equal_the_packages_own(tmp_path: Path) -> None:
    bundle = build_vad_bundle(tmp_path / "vad", postprocess=VAD_DECISIONS)
    rng = np.random.default_rng(7)
    audio = np.concatenate([speech(31, 8.0), rng.normal(0, 0.002, 2 * SR).astype(np.float32)])  # ends quiet: all close
    audio = audio[: len(audio) // HOP * HOP]
    (want,) = package_run(tmp_path / "pkg", [audio], segments=SEGMENTS)
    path = tmp_path / "audio.f32"
    audio.astype("<f4").tofile(path)
    served = Served(bundle, type="file", path=path)
    try:
        n = len(audio) // HOP
        assert wait_until(lambda: len(served.sink.results) == n, 120), len(served.sink.results)
        results = [r["result"] for r in served.sink.results]
        assert all(set(r) >= {"decision", "stream"} and "outputs" not in r for r in results)  # decisions, not arrays
        ours = [r["decision"]["label"] == "speech" for r in results]
        theirs = [p >= 0.5 for p in want["probabilities"]]
        agreement = float(np.mean(np.equal(ours, theirs)))
        events = [e for r in results for e in r.get("events", [])]
        segs = [(e["start_sample"], e["end_sample"]) for e in events]
        print(f"\ndecision agreement with the package {agreement:.4f} over {n} windows; segments ours {len(segs)} "
              f"theirs {len(want['segments'])}")
        assert agreement >= 0.99
        assert len(want["segments"]) >= 2, "the test audio should hold speech segments"
        assert len(segs) == len(want["segments"]), (segs, want["segments"])
        for (s0, e0), (s1, e1) in zip(segs, want["segments"]):
            assert abs(s0 - s1) <= HOP and abs(e0 - e1) <= HOP, (segs, want["segments"])
        assert all(e["label"] == "speech" and e["end_s"] == pytest.approx(e["end_sample"] / SR) for e in events)
    finally:
        served.close()


def _manifest(tmp: Path, post: dict[str, Any]) -> Any:
    from agent.vocabulary.manifest import parse_manifest

    d = yaml.safe_load(_VAD_MANIFEST)
    d["postprocess"] = post
    return parse_manifest(yaml.safe_dump(d), "bundle.yaml")


_VAD_MANIFEST = """
format: 1
name: v
version: 1
label: 1.0.0
created: '2026-01-01'
source: {framework: onnx, sha256: '0000000000000000000000000000000000000000000000000000000000000000'}
task: raw
input: {name: input, dtype: float32, shape: [batch, 576],
        frame: {kind: sensor, window: 576, hop: 512, channels: 1, dtype: float32, sample_rate: 16000}}
outputs: [{name: output, dtype: float32, shape: [batch, 1]}, {name: logits, dtype: float32, shape: [batch, 3]}]
preprocess: {layout: nw, dtype: float32}
postprocess: {type: raw}
variants: [{name: fp32, file: m.onnx, precision: fp32, providers: [CPUExecutionProvider]}]
selftest: {}
golden: [g.npz]
files: {m.onnx: '0000000000000000000000000000000000000000000000000000000000000000', g.npz: '0000000000000000000000000000000000000000000000000000000000000000'}
"""


def test_max_values_over_its_limit_is_refused_with_its_own_message(tmp_path: Path) -> None:
    from agent.errors import BundleError

    with pytest.raises(BundleError) as e:
        _manifest(tmp_path, {"type": "raw", "max_values": 5000})
    assert "postprocess.max_values: 5000 is over the limit of 4096" in str(e.value)
    assert "unsupported type" not in str(e.value)


def test_argmax_over_a_single_output_is_refused_and_a_threshold_decides_it(tmp_path: Path) -> None:
    from agent.errors import BundleError
    from agent.vocabulary.decoders import decode

    with pytest.raises(BundleError, match="argmax over the one value of 'output'.*rule: threshold"):
        _manifest(tmp_path, {"type": "raw", "decision": {"rule": "argmax", "output": "output"}})
    m = _manifest(tmp_path, {"type": "raw", "max_values": 0,
                             "decision": {"rule": "threshold", "output": "output", "threshold": 0.6, "labels": ["no", "yes"]}})
    assert decode(m.postprocess, {"output": np.array([[0.7]], np.float32)})["decision"]["label"] == "yes"
    assert decode(m.postprocess, {"output": np.array([[0.59]], np.float32)})["decision"]["label"] == "no"
    m = _manifest(tmp_path, {"type": "raw", "max_values": 0,
                             "decision": {"rule": "argmax", "output": "logits", "labels": ["a", "b", "c"]}})
    r = decode(m.postprocess, {"logits": np.array([[0.1, 2.0, 0.3]], np.float32)})
    assert r["decision"] == {"output": "logits", "class_id": 1, "label": "b", "value": 2.0}


def test_an_event_stage_without_sample_rate_or_decision_is_refused(tmp_path: Path) -> None:
    from agent.errors import BundleError

    with pytest.raises(BundleError, match="events: an event stage needs postprocess.decision"):
        _manifest(tmp_path, {"type": "raw", "events": {"label": "speech"}})
    with pytest.raises(BundleError, match="not a decision label"):
        _manifest(tmp_path, {"type": "raw", "decision": {"rule": "threshold", "labels": ["silence", "speech"]},
                             "events": {"label": "music"}})


def test_decision_fidelity_is_agreement_of_decisions_with_a_floor() -> None:
    """A variant whose probabilities drift where nobody decides (far from the threshold) keeps its
    decisions: SNR refused it; decision agreement passes it, and refuses flips under the floor."""
    from agent.proof.parity import fidelity_floors, judge_fidelity
    from agent.vocabulary.manifest import DecisionSpec, PostprocessSpec

    spec = PostprocessSpec(type="raw", outputs=("output",), decision=DecisionSpec("threshold", "output", 0, 0.5))
    rng = np.random.default_rng(0)
    ref = [{"output": np.array([[p]], np.float32)} for p in rng.choice([0.02, 0.97], 400)]
    drift = [{"output": np.clip(r["output"] + rng.normal(0, 0.02, (1, 1)), 0, 1).astype(np.float32)} for r in ref]
    ok = judge_fidelity(spec, drift, ref, fidelity_floors("raw"))
    assert ok.passed and ok.agreement is not None and ok.agreement.metrics["decision_agreement"] == 1.0
    flipped = [{"output": 1 - r["output"]} if i % 20 == 0 else r for i, r in enumerate(ref)]  # 5 % flips
    bad = judge_fidelity(spec, flipped, ref, fidelity_floors("raw"))
    assert not bad.passed and bad.findings[0].metric == "decision agreement"
    assert bad.findings[0].value == pytest.approx(0.95) and bad.findings[0].bound == 0.98
