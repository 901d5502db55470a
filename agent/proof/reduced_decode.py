"""The reduced-decode check: a camera's frames decoded at 1/2, 1/4 or 1/8 (JPEG's DCT scaling, a video
decoder's planes averaged) must reproduce what the full-size path serves on the winning candidate, or the
agent decodes at full size. Run by the self-test on its winner (`check_reduced_decode`); which scales and
paths a config's sources can choose is bounded here too (`SourceScaleLimit`, `choosable_scale`, `decode_paths`).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from agent.bundle.load import Bundle, GoldenSample
from agent.logsetup import get_logger
from agent.proof.parity import (
    agreement_score,
    fidelity_floors,
    judge_fidelity,
    judge_reproduction,
    reproduction_bounds,
    task_agreement,
)
from agent.proof.replay import golden_steps, is_sequence, run_golden
from agent.proof.session import open_session
from agent.proof.stage_proof import used_outputs
from agent.proof.stages import preprocessor_for
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.jpeg import camera_sized_reduced, max_decode_scale
from agent.vocabulary.yuv import camera_sized_reduced_yuv

log = get_logger("selftest")


REDUCED_SCALES = (2, 4, 8)


@dataclass(frozen=True)
class SourceScaleLimit:
    """The largest reduced decode scale one configured source could ever choose, as far as it is known before
    the source opens: a forced `decode_scale`, and the frame size a video file's header declares (a camera's or
    a stream's is unknown until it sends)."""

    forced: int | None = None             # decode_scale set to a number (1: the source never reduces)
    frame: tuple[int, int] | None = None  # (height, width); None: unknown, every scale may be chosen
    # the reduced paths it can serve through ("jpeg": DCT scaling, "video": decoder planes); None: unknown, both
    paths: frozenset[str] | None = None

    def largest(self, resize: Any) -> int:
        cap = self.forced or max(REDUCED_SCALES)
        if self.frame is None or resize is None:
            return cap
        h, w = self.frame
        # either orientation: a decoder that applies the file's rotation delivers the frame transposed
        return min(cap, max(max_decode_scale(resize, h, w), max_decode_scale(resize, w, h)))


def choosable_scale(limits: Sequence[SourceScaleLimit], resize: Any) -> int:
    """The largest scale any configured source can choose (a source serves min(what its frame allows, the proven
    scale)): proving a larger one buys nothing. No limits known: every scale."""
    return max((lim.largest(resize) for lim in limits), default=max(REDUCED_SCALES))


DECODE_PATHS = ("jpeg", "video")


def decode_paths(limits: Sequence[SourceScaleLimit]) -> tuple[str, ...]:
    """The reduced paths any configured source can serve through: a JPEG folder never needs the video planes
    proven, an H.264 file never the DCT scaling. No sources, or one not known before it opens: both."""
    if not limits or any(lim.paths is None for lim in limits):
        return DECODE_PATHS
    wanted = set().union(*(lim.paths or frozenset() for lim in limits))
    return tuple(p for p in DECODE_PATHS if p in wanted)


def check_reduced_decode(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
                         opened: Any = None, max_scale: int = max(REDUCED_SCALES), callers: int = 1,
                         paths: Sequence[str] = DECODE_PATHS) -> dict[str, Any]:
    """Prove the reduced-scale decode paths on the winning candidate: each golden raw frame as a camera `s`
    times its size sends it, decoded at 1/s by JPEG's DCT scaling (jpeg.camera_sized_reduced) and by the
    video path's plane averaging (yuv.camera_sized_reduced_yuv), then the bundle's preprocessing and the
    model. A speed path must *reproduce* what the full path serves: its decoded results (classes,
    detections) agree with the same candidate's full-size decode within the candidate's reproduction
    bounds; the fidelity floors against the references are checked too, but staying above a floor is
    never enough (a floor of 0.9 let 10 % of detections drop). Scales 2, 4, 8 in turn up to `max_scale` (the
    largest any configured source can choose: `choosable_scale`), stopping at the first failure; `max_scale`
    in the result is the largest that passed, `bound` the largest that was tried. `callers`: how many run the
    model at once in serving (`serving_workers`): never more run it at once here (the frames are made on two
    threads either way)."""
    out = _reduced_decode(bundle, c, settings, golden, opened, max_scale, callers, tuple(paths))
    return {**out, "bound": max(1, min(max_scale, max(REDUCED_SCALES))), "paths": list(paths)}


def _reduced_decode(bundle: Bundle, c: Candidate, settings: SessionSettings, golden: Sequence[GoldenSample],
                    opened: Any, max_scale: int, callers: int, paths: tuple[str, ...] = DECODE_PATHS) -> dict[str, Any]:
    m = bundle.manifest
    resize = m.preprocess.resize
    if max_scale < 2:
        return {"max_scale": 1, "reason": "no configured source can choose a reduced scale for this bundle's resize "
                "(its frames are too small): frames are decoded at full size", "scales": []}
    if m.frame.kind != "image" or resize is None:
        return {"max_scale": 1, "reason": "not an image bundle with a resize: frames are decoded at full size",
                "scales": []}
    if any(is_sequence(g) for g in golden):
        return {"max_scale": 1, "reason": "stateful golden sequences: reduced decode not proven", "scales": []}
    if opened is None:
        try:
            opened = open_session(bundle.path(m.variant(c.variant).file), c.provider, c.options, settings,
                                  sample=golden[0].input)
        except Exception as exc:
            return {"max_scale": 1, "reason": f"session creation error: {type(exc).__name__}: {exc}"[:400],
                    "scales": []}
    pre = preprocessor_for(bundle)
    floors = fidelity_floors(m.task, m.selftest.fidelity)
    bounds = reproduction_bounds(c.precision, c.provider, m.selftest.reproduction)
    refs = [r for g in golden for r in golden_steps(g.outputs, False, m.batch_axes)]
    best, reason, scales = 1, None, []
    model_gate = threading.Semaphore(max(callers, 1))  # the model is called at once by as many as serving calls it

    def served(frame_of: Callable[[GoldenSample], np.ndarray]) -> Callable[[GoldenSample], list[dict[str, np.ndarray]]]:
        """What serving outputs for the frame `frame_of` makes of a golden sample: preprocessing and the model."""
        def one(g: GoldenSample) -> list[dict[str, np.ndarray]]:
            tensor = pre(frame_of(g))
            with model_gate:
                return [split_batch(o, 0, m.batch_axes) for o in run_golden(opened, m, tensor, False)]
        return one

    try:  # what the full path serves on the same frames: the reference a shortcut must reproduce
        full = _on_two_threads(served(lambda g: g.raw), golden)
    except Exception as exc:
        return {"max_scale": 1, "reason": f"full decode: {type(exc).__name__}: {exc}"[:400], "scales": []}
    for s in (s for s in REDUCED_SCALES if s <= max_scale):
        # Both reduced paths serve at this one proven scale, so both must reproduce the full path: JPEG
        # decoded in the DCT (MJPEG cameras, .jpg folders) and the H.264/H.265 decoder's planes averaged
        # down before the colour conversion (agent.vocabulary.yuv, what the PyAV sources do).
        entry: dict[str, Any] = {"scale": s, "passed": True, "paths": {}}
        failed: str | None = None
        for path, reduce in (("jpeg", camera_sized_reduced), ("video", camera_sized_reduced_yuv)):
            if path not in paths:  # no configured source serves through it: proving it buys nothing
                continue
            stage = f"decode 1/{s}" + (" (video planes)" if path == "video" else "")
            try:
                def judge(got: list[dict[str, np.ndarray]], stage: str = stage) -> tuple[Any, Any]:
                    # decoded agreement with the full path (pixels differ after a reduced decode: no tensor bound)
                    got_used, full_used, refs_used = used_outputs(m, got, full, refs)  # the used outputs only
                    return (judge_reproduction(m.postprocess, got_used, full_used, bounds, "full path", stage=stage,
                                               tensor_bound=False),
                            judge_fidelity(m.postprocess, got_used, refs_used, floors, stage=stage))

                frame_of: Callable[[GoldenSample], np.ndarray] = functools.partial(_reduced_frame, reduce, s,
                                                                                     m.frame.color)
                got, judged = _until_decisive_miss(served(frame_of), golden,
                                                   _DecisiveMiss(m, bounds, full, stage))
                if judged < len(golden):  # refused already: the rest judged as the best they could be (= full)
                    got = got + full[len(got):]
                rep, fid = judge(got)
            except Exception as exc:
                failed = f"{stage}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                entry["paths"][path] = {"passed": False, "reason": failed}
                break
            ok = rep.passed and fid.passed and judged == len(golden)
            entry["paths"][path] = {"passed": ok, "reproduction": rep.to_dict(), "fidelity": fid.to_dict(),
                                    "samples": judged, "of": len(golden)}
            if path == "jpeg":  # the keys earlier reports carried, kept for readers of the JPEG path
                entry["reproduction"], entry["fidelity"] = rep.to_dict(), fid.to_dict()
            if not ok:
                failed = f"{stage}: " + "; ".join(f.text() for f in rep.findings + fid.findings)
                if judged < len(golden):
                    failed += f" (decided after {judged} of {len(golden)} samples: the rest could not save it)"
                break
        entry["passed"] = failed is None
        scales.append(entry)
        if failed is not None:
            reason = failed
            break
        best = s
    if best == 1 and reason is None:
        reason = "no reduced scale passed"
    if reason is None and best < max(REDUCED_SCALES):
        reason = f"scales above 1/{best} cannot be chosen by the configured sources (their frame size): not proven"
    log.info("selftest.reduced_decode", candidate=c.key, max_scale=best, reason=reason)
    return {"max_scale": best, "reason": reason, "scales": scales}


def _reduced_frame(reduce: Callable[[np.ndarray, int, str], np.ndarray], scale: int, color: str,
                   g: GoldenSample) -> np.ndarray:
    return reduce(g.raw, scale, color)


class _DecisiveMiss:
    """After the reduced path's outputs for the first samples (`got`, the newest `last` of them just made): is
    the shortcut refused whatever the other samples give? Only a sample that does not reproduce the full path
    exactly can make it so; then the judgement runs on these samples with every other one reproducing the full
    path (the best any could do: the score cannot rise above it). Sequences never reach here.
    A mask's IoU is never exactly 1 after a reduced decode: the judgement (a decode of every sample) runs only
    once the samples' shortfall could pull the mean IoU under its bound, not after every sample."""

    def __init__(self, m: Any, bounds: Any, full: Sequence[dict[str, np.ndarray]], stage: str) -> None:
        self.m, self.bounds, self.full, self.stage = m, bounds, full, stage
        self.shortfall = 0.0

    def __call__(self, got: list[dict[str, np.ndarray]], last: int) -> bool:
        n = len(got)
        new_got, new_full = used_outputs(self.m, got[n - last:], self.full[n - last:n])
        try:
            agreement = task_agreement(self.m.postprocess, new_got, new_full)
        except Exception:  # noqa: BLE001 - outputs the decoder cannot read: the whole judgement says why
            return True
        score = agreement_score(agreement)
        if score >= 1.0:
            return False
        if agreement.task == "segmentation":
            self.shortfall += (1.0 - score) * last
            if self.shortfall <= len(self.full) * (1.0 - self.bounds.min_agreement):
                return False
        best_got, best_full = used_outputs(self.m, list(got) + list(self.full[n:]), self.full)
        return not judge_reproduction(self.m.postprocess, best_got, best_full, self.bounds, "full path",
                                      stage=self.stage, tensor_bound=False).passed


def _until_decisive_miss(fn: Callable[[GoldenSample], list[dict[str, np.ndarray]]], golden: Sequence[GoldenSample],
                         refused: Callable[[list[dict[str, np.ndarray]], int], bool]
                         ) -> tuple[list[dict[str, np.ndarray]], int]:
    """`fn` over the golden samples in order, on up to two threads (one sample ahead), until `refused` says
    the outputs so far refuse the shortcut: a refused speed path costs the samples up to its first decisive
    miss (and the one then in flight on the other thread), not the whole set. The outputs of the samples judged, and how many."""
    got: list[dict[str, np.ndarray]] = []
    workers = min(2, len(os.sched_getaffinity(0)), len(golden))
    if workers < 2:
        for k, g in enumerate(golden):
            outs = fn(g)
            got += outs
            if refused(got, len(outs)):
                return got, k + 1
        return got, len(golden)
    with ThreadPoolExecutor(workers, thread_name_prefix="reduced-decode") as pool:
        ahead = [pool.submit(fn, g) for g in golden[:workers]]
        for k in range(len(golden)):
            outs = ahead.pop(0).result()
            got += outs
            if refused(got, len(outs)):
                for f in ahead:
                    f.cancel()
                return got, k + 1
            if k + workers < len(golden):
                ahead.append(pool.submit(fn, golden[k + workers]))
    return got, len(golden)


def _on_two_threads(fn: Callable[[GoldenSample], list[dict[str, np.ndarray]]],
                    golden: Sequence[GoldenSample]) -> list[dict[str, np.ndarray]]:
    """`fn` over every golden sample on up to two threads, outputs in the samples' order. Making camera-sized
    frames (1/4 of a 160x160 golden frame is a 640x640 JPEG encoded and decoded), preprocessing and running
    the model are the whole reduced-decode check; OpenCV and ONNX Runtime release the GIL there, and at boot
    the agent's own process is idle on the other core while its child proves (the demo's check, in one
    process: 149-189 ms with only the frames on two threads, 112-137 ms with everything)."""
    workers = min(2, len(os.sched_getaffinity(0)), len(golden))
    if workers < 2:
        return [o for g in golden for o in fn(g)]
    with ThreadPoolExecutor(workers, thread_name_prefix="reduced-decode") as pool:
        return [o for outs in pool.map(fn, golden) for o in outs]
