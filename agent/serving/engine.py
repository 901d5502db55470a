"""An Engine is what serving needs from a self-test winner: the session, the bundle's pre/postprocessing,
and the feeds of the model's other inputs (constants, metadata, state carried per source).

Swapping engines (a new bundle) is one reference assignment; frames already preprocessed for the old
engine finish on it, so the stream never stops. A new engine starts every source from its initial state.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from agent.bundle.load import Bundle
from agent.proof.session import OpenedSession, open_session
from agent.proof.stages import AnyPreprocessor, Postprocessor, VocabularyPostprocessor, postprocessor_for, preprocessor_for
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
from agent.logsetup import get_logger
from agent.serving.stream_time import stream_record
from agent.vocabulary.decisions import tracker_for
from agent.vocabulary.inputs import InputFeeder
from agent.vocabulary.preprocess import Geometry

log = get_logger("engine")


AUDIT_SOURCE = "__audit__"  # the audit's own runs (canary): never sampled by the tap


@dataclass(frozen=True)
class Engine:
    bundle: Bundle
    candidate: Candidate
    opened: OpenedSession
    preprocessor: AnyPreprocessor  # the vocabulary or the bundle's pre graph (agent.proof.stages)
    labels: tuple[str, ...]
    feeder: InputFeeder | None = None
    events: Any = None  # agent.vocabulary.decisions.SegmentTracker when the bundle declares an event stage
    # state is read, run and written back as one step: two workers must not interleave on a source
    _state_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # the serving crash marker of this session's first inferences (agent.service.serving_ledger)
    watch: Any = field(default=None, repr=False, compare=False)
    # the audit's tap (agent.service.audit.AuditTap): sees a sample of what this engine serves
    tap: Any = field(default=None, repr=False, compare=False)
    # the vocabulary's decoders or the bundle's post graph with its result kind (agent.proof.stages)
    postprocessor: Postprocessor | None = field(default=None, repr=False, compare=False)

    def decode(self, outputs: Mapping[str, np.ndarray], geometry: Geometry, max_bytes: int) -> dict[str, Any]:
        """One sample's outputs -> the result served (the publish stage runs the post graph here)."""
        post = self.postprocessor or VocabularyPostprocessor(self.bundle.manifest.postprocess, self.labels)
        return post.decode(outputs, geometry, max_bytes)

    @property
    def dynamic_batch(self) -> bool:
        """Frames may share a batch: a dynamic batch dimension, a fixed input size (fit_multiple makes the
        size follow each frame, so its frames run one at a time), and no state carried between frames."""
        m = self.bundle.manifest
        return not isinstance(m.input.shape[0], int) and self.preprocessor.fixed_size and not m.stateful

    @property
    def max_workers(self) -> int | None:
        """A stateful model's steps must run in frame order: one inference worker. None = no limit."""
        return 1 if self.bundle.manifest.stateful else None

    def run(self, tensor: np.ndarray, source: str = "", at: float | None = None,
            metadata: Mapping[str, Any] | None = None, frame: Any = None) -> dict[str, np.ndarray]:
        """Run one prepared tensor with every other input the model takes; carries state per source.
        `frame`: a sensor window (its `span` places it in its stream; its `state` is told what happened)."""
        w, t = self.watch, self.tap
        if w is None and t is None:
            return self._run(tensor, source, at, metadata, frame)
        if w is None:
            out = self._run(tensor, source, at, metadata, frame)
        else:
            w.before()
            try:
                out = self._run(tensor, source, at, metadata, frame)
            except BaseException:
                w.abandon()  # a run that raised is not in flight any more
                raise
            out = w.after(out)
        if t is not None and t.fn is not None and source != AUDIT_SOURCE:
            t.fn(self, tensor, out)
        return out

    def _run(self, tensor: np.ndarray, source: str, at: float | None,
             metadata: Mapping[str, Any] | None, frame: Any = None) -> dict[str, np.ndarray]:
        if self.feeder is None or not self.bundle.manifest.inputs:
            return self.opened.run(tensor)
        names = self.opened.output_names
        span = getattr(frame, "span", None)
        if not self.feeder.stateful:
            feeds = self.feeder.feeds(tensor, source, at, metadata)
            return dict(zip(names, self.opened.session.run(None, feeds)))
        if span is not None:  # state is the stream's (each UDP sender its own), whatever the source is called
            source = span.stream
        with self._state_lock:
            feeds = self.feeder.feeds(tensor, source, at, metadata, span=span)
            if span is not None:
                frame.state = note = self.feeder.last_note
                if note is not None and note.startswith("reset"):  # the result says so too (result.stream.state)
                    log.warning("state.reset", stream=span.stream, session=span.session, window=span.window, reason=note)
            outs = dict(zip(names, self.opened.session.run(None, feeds)))  # raised: the feeder's next window resets
            bad = self.non_finite(outs, self._carried_outputs)
            if bad:  # a NaN/inf state is never carried: the next window starts again and says why
                where = f"window {span.window} of the stream" if span is not None else "the last step"
                self.feeder.failed(source, f"{where} gave non-finite outputs {bad}")
            else:
                self.feeder.advance(source, outs)
        return outs

    @functools.cached_property
    def _carried_outputs(self) -> frozenset[str]:
        """Outputs judged before a stateful step's state is stored: those served and those fed back."""
        m = self.bundle.manifest
        return (frozenset(self.opened.output_names) - m.unused_outputs) | {x.from_output for x in m.inputs
                                                                           if x.kind == "state" and x.from_output}

    def non_finite(self, outputs: Mapping[str, np.ndarray], judged: frozenset[str] | None = None) -> list[str]:
        """The outputs with NaN/inf values among `judged` (default: every output but those outside
        postprocess.uses, which are never judged nor served)."""
        unused = self.bundle.manifest.unused_outputs
        return [k for k, v in outputs.items() if (k in judged if judged is not None else k not in unused)
                and v.dtype.kind == "f" and not np.isfinite(v).all()]

    def annotate(self, frame: Any, result: dict[str, Any]) -> dict[str, Any]:
        """A decoded result with what serving knows beyond the outputs: the stream time span a sensor
        window covers (and what happened to the state there), and the events of the bundle's event stage."""
        rec = stream_record(frame)
        if rec is None:
            return result
        result = {**result, "stream": rec}
        if self.events is not None:
            events = self.events.update(frame.span, result)
            if events:
                result["events"] = events
        return result

    @functools.cached_property
    def intra_op_threads(self) -> int:
        """Threads one `run` uses on the CPU provider (ORT's 0 means one per core)."""
        n = self.opened.session.get_session_options().intra_op_num_threads
        return n if n > 0 else len(os.sched_getaffinity(0))

    def reset_source(self, source: str) -> None:
        """A new stream on this source (a reconnect, a new file): its state starts again."""
        if self.feeder is not None:
            with self._state_lock:
                self.feeder.reset(source)

    def describe(self) -> dict[str, Any]:
        m = self.bundle.manifest
        return {"bundle": m.name, "version": m.version, "label": m.label, "variant": self.candidate.variant,
                "provider": self.candidate.provider, "effective_providers": list(self.opened.effective)}


def build_engine(bundle: Bundle, candidate: Candidate, settings: SessionSettings, watch: Any = None,
                 tap: Any = None, stage_watch: Callable[[str], Any] | None = None) -> Engine:
    """The serving session; `watch` (written before this is called) covers opening and first runs.
    `stage_watch(stage)` makes the watch of each stage graph the bundle ships ("pre", "post"), written
    before its session opens: a native crash in a stage is the stage's, not the candidate's."""
    model = bundle.path(bundle.manifest.variant(candidate.variant).file)
    opened = open_session(model, candidate.provider, candidate.options, settings)
    if watch is not None:
        watch.opened()
    m = bundle.manifest
    graphs = m.stage_files if stage_watch is not None else {}

    def stage(name: str, make: Callable[[Bundle], Any]) -> Any:
        w = stage_watch(name) if stage_watch is not None and name in graphs else None
        runner = make(bundle)  # a stage's session opens under its own watch, one stage at a time
        if w is not None:
            w.opened()
            runner.watch = w
        return runner

    pre, post = stage("pre", preprocessor_for), stage("post", postprocessor_for)
    return Engine(bundle, candidate, opened, pre, tuple(bundle.labels()), InputFeeder.for_manifest(m),
                  events=tracker_for(m.postprocess, m.frame.sample_rate), watch=watch, tap=tap,
                  postprocessor=post)
