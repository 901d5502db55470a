"""Decisions from raw outputs (a threshold or an argmax per frame) and segments of them in stream time.

Pure: `decide` turns one frame's outputs into a small decision; `SegmentTracker` turns one stream's
decisions into segments (start/end in samples and seconds of stream time) with hysteresis, a hangover
and a minimum duration -- the same rules as silero-vad's get_speech_timestamps (without padding), so a
VAD bundle's segments can be judged against the package's own. `decision_agreement` is the fidelity of
decisions: the share of frames on which two runs decide the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.vocabulary.manifest import DecisionSpec, EventSpec, PostprocessSpec

Outputs = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Decision:
    class_id: int
    label: str
    value: float  # the thresholded value, or the winning channel's value


def decision_output(spec: PostprocessSpec, outputs: Outputs) -> str:
    d = spec.decision
    assert d is not None
    return d.output or (spec.outputs[0] if spec.outputs else next(iter(outputs)))


def decide(spec: PostprocessSpec, outputs: Outputs) -> Decision:
    """One frame's decision (outputs without the batch dimension, or with a batch of one)."""
    d: DecisionSpec | None = spec.decision
    assert d is not None
    a = np.asarray(outputs[decision_output(spec, outputs)], dtype=np.float64)
    vec = a.reshape(-1, a.shape[-1])[0] if a.ndim else a.reshape(1)
    if d.rule == "threshold":
        if d.channel >= vec.size:  # a last dim the model leaves dynamic and this frame made smaller
            raise BundleError(f"key postprocess.decision.channel: {d.channel} is beyond the {vec.size} values of "
                              f"{decision_output(spec, outputs)!r} in this frame's output {list(a.shape)}: choose a "
                              "channel the output always has")
        v = float(vec[d.channel])
        cid = int(v >= d.threshold)  # NaN decides 0: never an event
        return Decision(cid, d.label(cid) if d.labels else str(cid), v)
    cid = int(np.argmax(vec))
    return Decision(cid, d.label(cid), float(vec[cid]))


def decision_record(spec: PostprocessSpec, outputs: Outputs) -> dict[str, Any]:
    dec = decide(spec, outputs)
    return {"output": decision_output(spec, outputs), "class_id": dec.class_id, "label": dec.label,
            "value": round(dec.value, 6) if math.isfinite(dec.value) else None}


def decision_agreement(spec: PostprocessSpec, got: Sequence[Outputs], ref: Sequence[Outputs]) -> float:
    """The share of frames on which two runs make the same decision (1.0 with no frames)."""
    if not got:
        return 1.0
    same = sum(decide(spec, g).class_id == decide(spec, r).class_id for g, r in zip(got, ref))
    return same / len(got)


@dataclass
class _Open:
    session: int
    start: int | None = None  # sample where the open segment started
    silence_from: int | None = None  # sample where the current run below off_threshold began
    last_end: int = 0


@dataclass
class SegmentTracker:
    """Per-stream segments of one decision label. `update(span, result)` -> events ended at this window.

    A window's time is its own samples' start (span.own_start: the context before it is the previous
    window's). A segment starts at the first window at or above the threshold (or deciding the label),
    and ends where a run below off_threshold began once that run lasted hangover_s; it is published if it
    lasted longer than min_duration_s. A stream that ends (a new session) closes its open segment at the
    last window's end.
    """

    spec: PostprocessSpec
    sample_rate: float
    _streams: dict[str, _Open] = field(default_factory=dict)

    MAX_STREAMS = 1024

    def _positive(self, dec: Mapping[str, Any]) -> tuple[bool, bool]:
        """(on, off): starts or keeps a segment; counts towards its end."""
        d, e = self.spec.decision, self.spec.events
        assert d is not None and e is not None
        if d.rule == "threshold":
            v = dec.get("value")
            v = -math.inf if v is None else float(v)
            on_label = e.label == (d.labels[1] if d.labels else "1")
            off = e.off_threshold if e.off_threshold is not None else d.threshold
            if on_label:
                return v >= d.threshold, v < off
            return v < d.threshold, v >= d.threshold
        hit = dec.get("label") == e.label
        return hit, not hit

    def _segment(self, name: str, o: _Open, end: int) -> dict[str, Any] | None:
        e = self.spec.events
        assert e is not None and o.start is not None
        if (end - o.start) <= e.min_duration_s * self.sample_rate:
            return None
        return {"type": "segment", "label": e.label, "stream": name, "session": o.session,
                "start_sample": o.start, "end_sample": end,
                "start_s": round(o.start / self.sample_rate, 6), "end_s": round(end / self.sample_rate, 6)}

    def update(self, span: Any, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        dec = result.get("decision")
        if dec is None:
            return []
        e = self.spec.events
        assert e is not None
        events: list[dict[str, Any]] = []
        o = self._streams.get(span.stream)
        if o is not None and o.session != span.session:
            if o.start is not None and (seg := self._segment(span.stream, o, o.last_end)):
                events.append(seg)
            o = None
        if o is None:
            o = _Open(span.session)
            self._streams[span.stream] = o
            while len(self._streams) > self.MAX_STREAMS:
                self._streams.pop(next(iter(self._streams)))
        at = int(span.own_start)
        on, off = self._positive(dec)
        if on and o.silence_from is not None:
            o.silence_from = None
        if on and o.start is None:
            o.start = at
        elif o.start is not None and off:
            if o.silence_from is None:
                o.silence_from = at
            if at - o.silence_from >= e.hangover_s * self.sample_rate:
                if seg := self._segment(span.stream, o, o.silence_from):
                    events.append(seg)
                o.start = o.silence_from = None
        o.last_end = int(span.end)
        return events

    def flush(self) -> list[dict[str, Any]]:
        """Every open segment, closed at its stream's last window (a stream that will not go on)."""
        out = []
        for name, o in self._streams.items():
            if o.start is not None and (seg := self._segment(name, o, o.last_end)):
                out.append(seg)
            o.start = o.silence_from = None
        return out


def tracker_for(spec: PostprocessSpec, sample_rate: float | None) -> SegmentTracker | None:
    if spec.type != "raw" or spec.events is None or spec.decision is None or not sample_rate:
        return None
    return SegmentTracker(spec, float(sample_rate))


__all__ = ["Decision", "EventSpec", "SegmentTracker", "decide", "decision_agreement", "decision_record", "tracker_for"]
