"""Feeds for a model's inputs besides the frame: constants, per-frame metadata and state carried per source.

Pure (numpy only): serving, the self-test's replay and `bundle create`'s calibration all build their
feeds here, so a stateful model sees the same inputs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from agent.errors import PreprocessError
from agent.vocabulary.manifest import ExtraInput, Manifest

Feeds = dict[str, np.ndarray]


def _batched_shape(x: ExtraInput, batch: int) -> tuple[int, ...]:
    # symbolic dims in a constant's or metadata's shape are the batch dimension
    return tuple(d if isinstance(d, int) else batch for d in x.shape)


def constant_value(x: ExtraInput, batch: int = 1) -> np.ndarray:
    v = np.asarray(x.value if x.kind == "constant" else x.default, dtype=x.dtype)
    shape = _batched_shape(x, batch)
    if v.shape == shape:
        return v
    try:
        return np.ascontiguousarray(np.broadcast_to(v, shape))
    except ValueError as exc:
        raise PreprocessError(f"input {x.name!r}: value of shape {v.shape} does not fit shape {list(x.shape)}") from exc


def initial_state(x: ExtraInput) -> np.ndarray:
    if isinstance(x.init, str):  # a tensor from the bundle (agent.bundle.state_files), never a silent fill
        value = getattr(x, "init_value", None)
        if value is None:
            raise PreprocessError(f"input {x.name!r}: its init {x.init} was not loaded with the bundle")
        return np.array(value, dtype=x.dtype, copy=True)
    return np.full(tuple(int(d) for d in x.shape), x.init, dtype=x.dtype)


@dataclass
class _SourceState:
    values: dict[str, np.ndarray]
    last_seen: float | None
    session: int = 0  # a sensor stream's session and the index of its last window whose outputs were stored
    window: int = -1  # (StreamSpan), -1: none yet
    fed: int | None = None  # the window fed to the model and not yet advanced (its run still going, or failed)
    broken: str | None = None  # why the state must not be carried (a window whose outputs were not finite)


class StreamPlace(Protocol):
    """Where a window sits in its stream (agent.serving.sensors.StreamSpan): enough to carry state by."""

    session: int
    window: int
    reset: str | None


MAX_TRACKED_SOURCES = 1024  # state kept for at most this many sources/streams (the least recently used is forgotten)


class InputFeeder:
    """Builds the feeds of one step and carries state per source (a camera, a UDP sender, a sequence).

    `feeds(tensor, source, at)` -> every input the model needs; `advance(source, outputs)` stores the
    outputs that feed state inputs on the next step. A gap longer than an input's reset_on_gap_s, or
    `reset(source)` (a new stream), starts that source from the initial state again. A sensor window's
    state is carried only from the window just before it whose outputs were stored: a window fed and
    never advanced (its run raised) or marked `failed` (non-finite outputs) is a hole, and the next
    window starts again, saying why in `last_note`. At most MAX_TRACKED_SOURCES sources are kept; the
    least recently used is forgotten first, so a long-lived stream outlives many short ones.
    """

    def __init__(self, frame_input: str, extra: Sequence[ExtraInput] = ()):
        self.frame_input = frame_input
        self.extra: tuple[ExtraInput, ...] = tuple(extra)
        self.states = tuple(x for x in self.extra if x.kind == "state")
        self._constants = {x.name: constant_value(x) for x in self.extra if x.kind == "constant"}
        self._sources: dict[str, _SourceState] = {}
        self._successor = False  # took over from another engine's feeder while streams went on (take_over)
        # what the last step did with its stream's state: carried, initial, or why it started again
        self.last_note: str | None = None

    @classmethod
    def for_manifest(cls, manifest: Manifest) -> "InputFeeder":
        return cls(manifest.input.name, manifest.inputs)

    @property
    def stateful(self) -> bool:
        return bool(self.states)

    def reset(self, source: str) -> None:
        self._sources.pop(source, None)

    def take_over(self, old: "InputFeeder", why: str = "the engine changed (an update or a reload)") -> None:
        """This feeder's engine replaces `old`'s while streams go on: each stream `old` was serving keeps its
        place, so its next window here starts again saying `reset: <why>` -- never that the windows the old
        engine served were not served. No state crosses engines (another model, another state)."""
        self._successor = True
        for source, st in list(old._sources.items()):
            if st.session:  # a sensor stream's place (frames without a span start afresh anyway)
                s = self._fresh(source)
                s.session, s.window, s.broken = st.session, st.window, why

    def failed(self, source: str, why: str) -> None:
        """The step just fed for `source` gave outputs that must not be carried (not finite): its state is
        not stored, and the next step starts again from the initial state, saying `reset: <why>`."""
        s = self._sources.get(source)
        if s is None:
            return
        if s.fed is None:  # not a sensor window's step (no span): nothing to say, just start again
            self._sources.pop(source, None)
        else:
            s.broken, s.fed = why, None

    def state_of(self, source: str) -> dict[str, np.ndarray]:
        s = self._sources.get(source)
        return {x.name: (s.values[x.name] if s else initial_state(x)) for x in self.states}

    def _fresh(self, source: str) -> _SourceState:
        s = _SourceState({x.name: initial_state(x) for x in self.states}, None)
        self._sources.pop(source, None)
        self._sources[source] = s
        while len(self._sources) > MAX_TRACKED_SOURCES:
            self._sources.pop(next(iter(self._sources)))
        return s

    def _in_stream(self, source: str, span: StreamPlace) -> _SourceState:
        """State by stream time: a new session starts again, and so does a hole in the window indices
        (windows dropped before they ran) -- state never carries across a hole, and the note says so."""
        s = self._sources.get(source)
        if s is None:
            note = ("initial" if span.window == 0 else
                    # the previous engine served (or was serving) this stream's earlier windows
                    f"initial: the engine changed (an update or a reload) before window {span.window}"
                    if self._successor else f"initial ({span.window} windows of the stream not served)")
        elif s.session != span.session:
            note = f"reset: {span.reset or 'new stream session'}"
        elif s.broken is not None:
            note = f"reset: {s.broken}"
        elif s.fed is not None:  # fed to the model, never advanced: its run raised
            note = f"reset: window {s.fed} of the stream did not run (an inference error)"
        elif span.window != s.window + 1:
            note = f"reset: {span.window - s.window - 1} windows of the stream were not served"
        else:
            s.fed = span.window
            self._used(source, s)
            self.last_note = "carried"
            return s
        s = self._fresh(source)
        s.session, s.window, s.fed = span.session, span.window - 1, span.window
        self.last_note = note
        return s

    def _used(self, source: str, s: _SourceState) -> None:
        """Most recently used last: the first in order is the one forgotten when too many are kept."""
        self._sources.pop(source, None)
        self._sources[source] = s

    def _current(self, source: str, at: float | None) -> _SourceState:
        s = self._sources.get(source)
        if s is not None and at is not None and s.last_seen is not None:
            gap = at - s.last_seen
            if any(x.reset_on_gap_s is not None and (gap > x.reset_on_gap_s or gap < 0) for x in self.states):
                s = None
        if s is None:
            s = self._fresh(source)
        else:
            self._used(source, s)
        if at is not None:
            s.last_seen = at
        return s

    def feeds(self, tensor: np.ndarray, source: str = "", at: float | None = None,
              metadata: Mapping[str, Any] | None = None, span: StreamPlace | None = None) -> Feeds:
        """`span`: the window's place in its stream; then gaps and restarts are the stream's (measured in
        stream time by the source), not the wall-clock `at`."""
        batch = int(tensor.shape[0]) if tensor.ndim else 1
        if self.states and batch != 1:
            raise PreprocessError(f"a stateful model runs one frame per step per source, got a batch of {batch}")
        out: Feeds = {self.frame_input: tensor}
        s = None
        if self.states:
            s = self._in_stream(source, span) if span is not None else self._current(source, at)
        for x in self.extra:
            if x.kind == "constant":
                v = self._constants[x.name]
                out[x.name] = v if batch == 1 else constant_value(x, batch)
            elif x.kind == "state":
                assert s is not None
                out[x.name] = s.values[x.name]
            else:
                given = (metadata or {}).get(x.name)
                if given is None:
                    out[x.name] = constant_value(x, batch)
                else:
                    out[x.name] = np.ascontiguousarray(np.broadcast_to(np.asarray(given, dtype=x.dtype),
                                                                       _batched_shape(x, batch)))
        return out

    def advance(self, source: str, outputs: Mapping[str, np.ndarray]) -> None:
        """Store the outputs that feed the next step's state inputs."""
        if not self.states:
            return
        s = self._sources.get(source)
        if s is None:
            s = self._current(source, None)
        for x in self.states:
            assert x.from_output is not None
            s.values[x.name] = np.asarray(outputs[x.from_output], dtype=x.dtype).reshape(initial_state(x).shape)
        if s.fed is not None:  # the window fed is now the stream's last: the next one carries from it
            s.window, s.fed = s.fed, None


def sequence_feeds(feeder: InputFeeder, tensors: Sequence[np.ndarray], outputs: Sequence[Mapping[str, np.ndarray]]) -> list[Feeds]:
    """The feeds of every step of a sequence whose outputs are known (a reference run): for calibration."""
    feeder.reset("sequence")
    out = []
    for t, o in zip(tensors, outputs):
        out.append(feeder.feeds(t, "sequence"))
        feeder.advance("sequence", o)
    return out
