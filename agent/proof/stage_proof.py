"""Proof per stage: reproduction of the post graph's outputs and fidelity of the FINAL served result.

Fidelity is judged against the source package's own answers (golden/answers.json, by the result kind's metric)
when the bundle carries them; without them, against our own decoding of the source's tensors, with a warning
that says so (a wrong decoder shared by both sides cannot fail that comparison). Every finding names its stage.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from agent.proof.parity import (
    Finding,
    FidelityFloors,
    QuestionResult,
    ReproductionBounds,
    TaskAgreement,
    judge_fidelity,
    judge_reproduction,
)
from agent.bundle.load import Bundle, GoldenSample
from agent.proof.stages import AnyPreprocessor, GraphPostprocessor, Postprocessor, postprocessor_for, preprocessor_for
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.kinds import vocabulary_kinds
from agent.vocabulary.manifest import Manifest
from agent.vocabulary.preprocess import Geometry

Outputs = Mapping[str, np.ndarray]
OWN_DECODING = ("judged against our own decoding of the source's tensors (the bundle carries no package answers, "
                "golden/answers.json): a decoder wrong on both sides cannot fail this")


def result_kind(m: Manifest) -> str | None:
    """The kind the bundle serves: its post graph's, its declared `postprocess.result`, or the vocabulary's."""
    if m.postprocess.result is not None:
        return m.postprocess.result.kind
    if m.postprocess.type == "raw" and m.postprocess.decision is None:
        return None  # raw arrays: no kind judges them
    return vocabulary_kinds().get(m.postprocess.type)  # so package answers judge vocabulary bundles too


def kind_floors(kind: Any, authored: Mapping[str, float]) -> dict[str, float]:
    """The kind's default floors with the author's (`selftest.fidelity`) over them; never what was measured."""
    floors = dict(getattr(kind, "DEFAULT_FLOORS", {}))
    floors.update({k: float(v) for k, v in authored.items() if k in floors})
    return floors


def _used(outs: Sequence[Outputs], used: Sequence[str]) -> list[dict[str, np.ndarray]]:
    return [{k: v for k, v in o.items() if k in used} for o in outs]


def used_outputs(m: Manifest, *sets: Sequence[Outputs]) -> list[list[dict[str, np.ndarray]]]:
    """Each set of outputs reduced to the outputs the bundle uses (`postprocess.uses`): the rest are never judged."""
    if not m.postprocess.uses:
        return [list(map(dict, s)) for s in sets]
    return [_used(s, m.postprocess.uses) for s in sets]


def post_tensors(post: GraphPostprocessor, outs: Sequence[Outputs], geoms: Sequence[Geometry]) -> list[dict[str, np.ndarray]]:
    return [post.tensors(o, g) for o, g in zip(outs, geoms)]


def judge_post_reproduction(m: Manifest, post: GraphPostprocessor, got: Sequence[Outputs], geoms: Sequence[Geometry],
                            recorded: Sequence[Outputs] | None, bounds: ReproductionBounds) -> list[Finding]:
    """The post graph on this candidate's outputs against the post outputs `bundle create` recorded on the same
    variant (`post.<variant>.*`), allclose per output; findings at stage post."""
    if recorded is None:
        return []
    mine = post_tensors(post, got, geoms)
    # the post outputs are the kind's fields, each its own tensor: one range per output (the model's axis is not theirs)
    spec = replace(m.postprocess, stage_channel_axis=None)
    q = judge_reproduction(spec, mine, [dict(r) for r in recorded], bounds, "variant", stage="post")
    return list(q.findings)


def _agreement(kind: str, figures: Mapping[str, Any], findings: Sequence[Finding]) -> TaskAgreement:
    metrics = {k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(float(v))}
    worst = next((f.sample for f in findings if f.sample is not None), None)
    return TaskAgreement(kind, metrics, worst, "; ".join(f.text() for f in findings[:1]))


def judge_final_fidelity(m: Manifest, post: Postprocessor, got: Sequence[Outputs], refs: Sequence[Outputs],
                         geoms: Sequence[Geometry], answers: Any, floors: FidelityFloors,
                         stage: str | None = None) -> QuestionResult:
    """Fidelity of the final served result. With the package's answers: the result served on each golden frame
    (device pre -> candidate's model -> post -> kind) against them, by the kind's metric. Without: a post graph's
    result on the candidate's outputs against its result on the source's tensors; the vocabulary as before.
    Both without answers carry the warning OWN_DECODING."""
    name = result_kind(m)
    if answers is not None and name is not None:
        from agent.results import kind_for

        name = getattr(answers, "kind", None) or name
        kind = kind_for(name)
        served = [post.decode(o, g, 0) for o, g in zip(got, geoms)]
        floors_used = kind_floors(kind, m.selftest.fidelity)
        figures, findings = kind.fidelity(served, list(answers.results), floors_used, stage=stage or "post")
        return QuestionResult("fidelity", "package answers", tuple(findings), _agreement(name, figures, findings),
                              bounds=floors_used)
    warning = Finding("fidelity", OWN_DECODING, None, None, stage or ("post" if m.postprocess.graph else "model"))
    if isinstance(post, GraphPostprocessor) and name is not None:
        from agent.results import kind_for

        kind = kind_for(name)
        served = [post.decode(o, g, 0) for o, g in zip(got, geoms)]
        ours = [post.decode(r, g, 0) for r, g in zip(refs, geoms)]
        figures, findings = kind.fidelity(served, ours, kind_floors(kind, m.selftest.fidelity), stage=stage or "post")
        return QuestionResult("fidelity", "source tensors, our decoding", tuple(findings),
                              _agreement(name, figures, findings), bounds=kind_floors(kind, m.selftest.fidelity),
                              warnings=(warning,))
    q = judge_fidelity(m.postprocess, got, refs, floors, **({"stage": stage} if stage else {}))
    return replace(q, warnings=q.warnings + (warning,))


def load_answers(bundle: Bundle, samples: int) -> Any:
    """The package's own results on the golden samples (golden/answers.json), or None when the bundle has none."""
    path = bundle.answers_path()
    if path is None:
        return None
    from agent.results.answers import read_answers

    return read_answers(path, samples, str(path))


def golden_geometries(pre: AnyPreprocessor, golden: Sequence[GoldenSample]) -> list[Geometry]:
    """Each golden frame's geometry as this device's preprocessing gives it (a post graph's frame_size/geometry)."""
    return [pre.geometry(g.raw) for g in golden]


def recorded_post(golden: Sequence[GoldenSample], variant: str) -> list[dict[str, np.ndarray]] | None:
    """The post graph's outputs `bundle create` recorded on this variant's outputs, or None when it did not."""
    key = f"post.{variant}"
    if not golden or not all(key in g.stage_outputs for g in golden):
        return None
    return [g.stage_outputs[key] for g in golden]


def judge_size_probes(opened: Any, m: Manifest, variant: str, golden: Sequence[GoldenSample],
                      bounds: ReproductionBounds, pre: AnyPreprocessor, tensor_bound: bool = True) -> list[Finding]:
    """The frames at the declared size extremes (`bundle create` records them for frames of any size): this
    device's preprocessing and candidate against what the variant computed there at build time, findings at stage
    `frame size <w>x<h>`; a kernel or an INT8 that breaks only on large frames is caught before serving.
    `tensor_bound=False` where this device's image library rounds differently (agent.proof.pre_compare): a probe
    holds no bundled tensor to prove the model on, so its decoded answer is judged, as the golden set's task is."""
    from agent.vocabulary.inputs import InputFeeder

    findings: list[Finding] = []
    feeder = InputFeeder.for_manifest(m)
    names = [o.name for o in opened.session.get_outputs()]
    for g in golden:
        for raw, recorded in g.size_probes:
            if variant not in recorded:
                continue
            got = dict(zip(names, opened.session.run(None, feeder.feeds(pre(raw), "selftest"))))
            mine, want = used_outputs(m, [{k: v[0] for k, v in got.items()}],
                                      [{k: v[0] for k, v in recorded[variant].items()}])
            q = judge_reproduction(m.postprocess, mine, want, bounds, "variant",
                                   stage=f"frame size {raw.shape[1]}x{raw.shape[0]}", tensor_bound=tensor_bound)
            findings += q.findings
    return findings


def exercise_stage(bundle: Bundle, stage: str, golden: Sequence[GoldenSample],
                   geometries: Sequence[Geometry] | None = None) -> list[Geometry]:
    """Run one stage graph ("pre" or "post") on the golden samples in its own session, as serving runs it: the
    self-test child's `stage:<stage>` step, so a native crash inside a stage is charged to the stage (which no
    candidate can serve without), never to a model candidate. Errors ORT raises are left to the candidates'
    trials, which name the stage; returns each frame's geometry (for the post stage)."""
    plain = [g for g in golden if not g.sequence]
    try:
        if stage == "pre":
            pre = preprocessor_for(bundle)
            return [pre.geometry(g.raw) for g in plain]
        post = postprocessor_for(bundle)
        if isinstance(post, GraphPostprocessor):
            # the pre stage's geometries when its step just made them; else the (vocabulary) pre is built here
            geoms = list(geometries) if geometries is not None else [
                preprocessor_for(bundle).geometry(g.raw) for g in plain]
            for g, geom in zip(plain, geoms):
                post.tensors(split_batch(g.outputs, 0, bundle.manifest.batch_axes), geom)
    except Exception:  # noqa: BLE001 -- a Python-level error is the trials' to report, with its stage
        pass
    return list(geometries or [])
