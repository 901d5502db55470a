"""The build's judges of a variant's final results: the stage graphs' golden outputs, the package's own answers
(their kind, and FP32 against them before quantisation), the frame-size extremes, and the quality gate that refuses
(or marks below_floor) a variant under a floor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agent.bundle.build_runs import VariantBuild, _cpu_session, _figures, _run_all, _used
from agent.bundle.build_spec import CreateOptions, charset_file
from agent.bundle.samples import SampleSet
from agent.errors import BundleError, QualityError, StageOutputError
from agent.logsetup import get_logger
from agent.proof.parity import Finding, judge_fidelity
from agent.vocabulary.batch_axis import spec_axes
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.kinds import vocabulary_kinds
from agent.vocabulary.manifest import postprocess_from_dict

log = get_logger("bundle.create")  # the build's events keep the command's logger


BELOW_FLOOR_CHARS = 4000  # the manifest's below_floor text: what a report shows beside the variant


def _each_stage_first(problems: Sequence[str]) -> list[str]:
    """The problems with the first of each stage ("at stage build golden", "... held-out vs package", "... frame
    size 360x480") before the rest: the below_floor text is cut at BELOW_FLOOR_CHARS, and a long list of one
    stage's findings must not cut every other stage's out of it."""
    seen: set[str] = set()
    first: list[str] = []
    rest: list[str] = []
    for text in problems:
        m = re.search(r" at stage (.+?)(?: \(|$)", text)
        stage = m.group(1) if m else text
        (rest if stage in seen else first).append(text)
        seen.add(stage)
    return first + rest


def _quality_gate(builds: Sequence[VariantBuild], task: str, opts: CreateOptions) -> None:
    """Refuse (or, with --keep-low-quality, mark `below_floor`) every variant under a fidelity floor
    or an author's bound. Floors come from the spec or the per-task defaults, never from a measurement."""
    fp32 = builds[0].quality
    for b in builds:
        q = b.quality
        problems = list(b.problems)
        if b is not builds[0] and "heldout_top1" in q and "heldout_top1" in fp32:
            drop = (fp32["heldout_top1"] - q["heldout_top1"]) * 100
            q["top1_drop_points"] = round(drop, 3)
            if drop > opts.max_top1_drop:
                problems.append(f"{b.name} held-out top-1 {q['heldout_top1']:.4f} is {drop:.2f} points under fp32 "
                                f"{fp32['heldout_top1']:.4f} (bound {opts.max_top1_drop} points)")
        elif b is not builds[0] and task in ("classification", "detection"):
            key = {"classification": "top1_agreement", "detection": "recall"}[task]
            prefix = "heldout_" if f"heldout_{key}" in q else "golden_"
            value = q.get(f"{prefix}{key}")
            if value is not None and value < opts.min_agreement:
                problems.append(f"{b.name} {prefix}{key} with fp32 = {value:.4f}, under the bound {opts.min_agreement}")
        if not problems:
            continue
        problem = f"variant {b.name}: " + "; ".join(_each_stage_first(problems))
        if not opts.keep_low_quality:
            raise QualityError(f"refusing the bundle: {problem}; pass --keep-low-quality to keep it marked "
                               f"below_floor (never selected unless the config pins it)")
        b.below_floor = problem[:BELOW_FLOOR_CHARS]
        log.warning("bundle.create.below_floor_kept", variant=b.name, problem=problem)


@dataclass
class GoldenStages:
    """The stage graphs' outputs on the golden samples, recorded per sample as the self-test's reproduction
    reference: `pre.geometry`, `post.<variant>.<output>` (post on each variant's outputs) and
    `post.reference.<output>` (post on the source's)."""

    pre: Any
    post: Any  # agent.proof.stages' post-processor: the vocabulary's or the graph's
    geometries: list[Any]
    pre_geometry: list[np.ndarray | None]
    axes: dict[str, int] = field(default_factory=dict)  # the outputs' batch axes (outputs.<name>.batch_axis)

    @classmethod
    def build(cls, root: Path, spec: Mapping[str, Any], pre: Any, golden: SampleSet, labels: Sequence[str],
              sequence: bool) -> "GoldenStages":
        from agent.proof.stages import GEOMETRY, GraphPostprocessor, GraphPreprocessor, VocabularyPostprocessor

        post_spec = postprocess_from_dict(spec["postprocess"])
        from agent.proof.stages import read_charset

        rel = charset_file(spec)
        charset = read_charset(root / rel) if rel else None
        post: Any = (GraphPostprocessor(root / post_spec.graph, post_spec, labels, charset) if post_spec.graph
                     else VocabularyPostprocessor(post_spec, labels))
        axes = spec_axes(spec)
        if sequence:
            return cls(pre, post, [], [], axes)
        geoms, pre_geometry = [], []
        for raw in golden.raw:
            if isinstance(pre, GraphPreprocessor):
                outs = pre.run(raw)
                pre_geometry.append(outs.get(GEOMETRY))
            else:
                pre_geometry.append(None)
            geoms.append(pre.geometry(raw))
        return cls(pre, post, geoms, pre_geometry, axes)

    def recorded(self, i: int, variants: Mapping[str, Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from agent.proof.stages import GraphPostprocessor

        out: dict[str, np.ndarray] = {}
        if i < len(self.pre_geometry) and self.pre_geometry[i] is not None:
            out["pre.geometry"] = np.asarray(self.pre_geometry[i])
        if isinstance(self.post, GraphPostprocessor) and self.geometries:
            for name, outs in [*variants.items(), ("reference", reference)]:
                tensors = self.post.tensors(split_batch(outs, 0, self.axes), self.geometries[i])
                out.update({f"post.{name}.{k}": np.asarray(v) for k, v in tensors.items()})
        return out


def golden_answers_text(golden: Path, samples: int) -> str | None:
    """The package's own answers of a golden set (`answers.json` beside a directory's frames, or an npz's
    `answers`), checked (kind, one result per sample, each readable by its kind), as the text the bundle keeps."""
    from agent.results.answers import has_answers, read_answers

    return read_answers(golden, samples).to_json() if has_answers(golden) else None


def check_answers_kind(spec: Mapping[str, Any], kind: str, where: object) -> None:
    """The package's answers (golden or held-out, at `where`) must be of the kind the bundle serves."""

    post = spec.get("postprocess") or {}
    serves = (post.get("result") or {}).get("kind") or vocabulary_kinds().get(post.get("type", ""))
    if serves is not None and serves != kind:
        key = "postprocess.result.kind" if (post.get("result") or {}).get("kind") else f"postprocess.type {post.get('type')}"
        raise BundleError(f"{where}: the package's answers are of kind {kind!r}, the bundle serves kind "
                          f"{serves!r} ({key}): give answers of the kind the bundle serves")


def check_against_answers(spec: Mapping[str, Any], stages: GoldenStages, fp32: Sequence[Mapping[str, np.ndarray]],
                          answers_text: str, samples: int, opts: CreateOptions, have_inputs: bool) -> None:
    """The FP32 model's FINAL result (pre stage -> model -> post stage -> kind) against the package's own answers,
    by the kind's metric, before quantisation: a wrong decoder (a YOLOX head declared as yolov5) is refused here
    naming the stage, metric, value, bound and sample; a golden set that cannot fail a metric is warned about."""
    from agent.proof.stage_proof import kind_floors
    from agent.results import kind_for
    from agent.results.answers import golden_warnings, read_answers

    answers = read_answers(json.loads(answers_text), samples, str(opts.golden))
    check_answers_kind(spec, answers.kind, opts.golden)
    kind = kind_for(answers.kind)
    for w in golden_warnings(answers):
        log.warning("bundle.create.golden_cannot_fail", kind=answers.kind, warning=w)
    served = [stages.post.decode(o, g, 0) for o, g in zip(fp32, stages.geometries)]
    floors = kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {})
    figures, findings = kind.fidelity(served, list(answers.results), floors, stage="post")
    log.info("bundle.create.answers_checked", kind=answers.kind, package=getattr(answers, "package", None),
             findings=len(findings))
    if findings:
        post_key = "postprocess.graph" if stages.post.stage_graph else "postprocess (type, layout, output)"
        pre_key = "preprocess.graph" if spec.get("preprocess", {}).get("graph") else "preprocess"
        where = (f"the pre stage reproduced the package's input tensors, so check {post_key}" if have_inputs else
                 f"check {post_key} (stage post) or {pre_key} (stage pre): give the package's input tensors "
                 "(`input` in the golden set) to tell them apart")
        raise BundleError(f"{opts.golden}: the FP32 model with this spec does not reproduce the package's own "
                          f"answers (before quantisation): " + "; ".join(f.text() for f in findings[:4]) + f"; {where}")


def size_extremes(frame: Any, golden: SampleSet) -> list[np.ndarray]:
    """For frames of any size: the first golden frame at the smallest and at the largest declared size
    (input.frame.min_size / max_size), the sizes a model must be calibrated and proven at."""
    if not getattr(frame, "any_size", False) or frame.max_size is None or not len(golden):
        return []
    import cv2

    base = golden.raw[0]
    out = []
    for h, w in (tuple(frame.min_size), tuple(frame.max_size)):
        img = cv2.resize(base, (int(w), int(h)), interpolation=cv2.INTER_LINEAR)
        out.append(img if img.ndim == base.ndim else img[..., None])
    return out


def judge_sizes(sess: Any, fp32: Any, frames: Sequence[np.ndarray], pre: Any, feeder: InputFeeder,
                spec: Mapping[str, Any], stages: GoldenStages, floors: Any) -> tuple[dict[str, Any], list[str]]:
    """A reduced-precision variant against FP32 on the frames of `size_extremes`, by the final result's kind (or
    the task's fidelity for raw outputs): an INT8 whose in-graph coordinates saturate beyond the calibrated
    size is refused naming the frame size, metric, value and bound."""
    from agent.proof.stage_proof import kind_floors

    post_spec = postprocess_from_dict(spec["postprocess"])
    kind_name = post_spec.result.kind if post_spec.result is not None else (
        None if post_spec.type == "raw" and post_spec.decision is None else vocabulary_kinds().get(post_spec.type))
    figures: dict[str, Any] = {}
    problems: list[str] = []
    for raw in frames:
        size = f"{raw.shape[1]}x{raw.shape[0]}"
        t = pre(raw)
        got, ref = (split_batch(_run_all(s, [t], feeder)[0], 0, spec_axes(spec)) for s in (sess, fp32))
        stage = f"build frame size {size} vs fp32"
        if kind_name is not None:
            from agent.results import kind_for

            kind = kind_for(kind_name)
            geometry = pre.geometry(raw)
            want = stages.post.decode(ref, geometry, 0)
            try:
                served = stages.post.decode(got, geometry, 0)
            except StageOutputError as exc:  # the variant fails at this size, not the build
                findings = [Finding("fidelity", "result the post stage serves", None, None, "post", None,
                                    f"{stage}: {exc}")]
            else:
                _figs, findings = kind.fidelity([served], [want],
                                                kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {}),
                                                stage=stage)
        else:  # the outputs the bundle uses only (postprocess.uses), as everywhere else
            q = judge_fidelity(post_spec, _used([got], post_spec.uses), _used([ref], post_spec.uses), floors, stage=stage)
            findings = list(q.findings)
            figures.update(_figures(f"size_{size}_", q))
        figures[f"size_{size}_findings"] = len(findings)
        problems += [f.text() for f in findings]
    return figures, problems


def judge_final_results(stages: GoldenStages, outs: Sequence[Mapping[str, np.ndarray]], geometries: Sequence[Any],
                        references: Sequence[Mapping[str, np.ndarray]], answers_text: str | None,
                        spec: Mapping[str, Any], stage: str) -> tuple[dict[str, float], list[Any]]:
    """A variant's final results (its outputs -> post stage -> kind) against the package's answers, or without
    them against the final results of the references' outputs, by the kind's fidelity: the gate the device applies."""
    from agent.proof.stage_proof import kind_floors
    from agent.results import kind_for

    post_spec = postprocess_from_dict(spec["postprocess"])
    if answers_text is not None:
        doc = json.loads(answers_text)
        name, want = doc["kind"], doc["results"]
    else:
        name = post_spec.result.kind if post_spec.result is not None else vocabulary_kinds().get(post_spec.type, "")
        want = []
        for i, (r, g) in enumerate(zip(references, geometries)):
            try:
                want.append(stages.post.decode(split_batch(r, 0, stages.axes), g, 0))
            except StageOutputError as exc:  # what every variant is judged against: the author's set is at fault
                raise BundleError(f"{stage}: the reference outputs of sample {i} (what every variant is judged "
                                  f"against) are refused by the post stage: {exc}") from exc
    kind = kind_for(name)
    served = []
    for i, (o, g) in enumerate(zip(outs, geometries)):
        try:
            served.append(stages.post.decode(split_batch(o, 0, stages.axes), g, 0))
        except StageOutputError as exc:  # this variant's outputs the post stage refuses: the variant fails, not the build
            return {}, [Finding("fidelity", "result the post stage serves", None, None, "post", i, f"{stage}: {exc}")]
    figures, findings = kind.fidelity(served, want, kind_floors(kind, (spec.get("selftest") or {}).get("fidelity") or {}),
                                      stage=stage)
    return ({k: round(float(v), 6) for k, v in figures.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)}, list(findings))


def size_probe_arrays(frames: Sequence[np.ndarray], pre: Any, feeder: InputFeeder,
                      variants: Mapping[str, Path]) -> dict[str, np.ndarray]:
    """Golden arrays `size.<k>.raw` and `size.<k>.variant.<variant>.<output>`: each size-extreme frame and what
    every variant computed on it here (graph optimisation "all", as a device runs it), for the device's
    reproduction at the smallest and largest declared frame size."""
    out: dict[str, np.ndarray] = {}
    if not frames:
        return out
    tensors = [pre(f) for f in frames]
    for name, path in variants.items():
        sess = _cpu_session(path, optimize=True)
        for k, outs in enumerate(_run_all(sess, tensors, feeder)):
            out.update({f"size.{k}.variant.{name}.{o}": v for o, v in outs.items()})
    for k, f in enumerate(frames):
        out[f"size.{k}.raw"] = np.asarray(f)
    return out
