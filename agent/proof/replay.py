"""Run a golden sample or a golden sequence through a session and return the outputs of every step.

The one place the self-test (and `bundle create`) feed a model: the frame tensor plus the bundle's
constant, metadata and state inputs, with state carried from step to step as serving carries it.

    outs = replay(session_runner(opened.session), manifest, golden.input, sequence=golden.sequence)
    # -> one {output: array} per step; compare outs[t] with golden.outputs[name][t]
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from agent.vocabulary.decoders import split_batch
from agent.vocabulary.inputs import Feeds, InputFeeder
from agent.vocabulary.manifest import Manifest

Outputs = dict[str, np.ndarray]
Run = Callable[[Feeds], Outputs]


def session_runner(session: Any) -> Run:
    """A Run over an onnxruntime.InferenceSession (or anything with get_outputs() and run(None, feeds))."""
    names = [o.name for o in session.get_outputs()]

    def run(feeds: Feeds) -> Outputs:
        return dict(zip(names, session.run(None, feeds)))

    return run


def steps_of(tensor: np.ndarray, sequence: bool) -> list[np.ndarray]:
    """A golden tensor as the per-step tensors a model takes: [T, 1, ...] -> T tensors [1, ...]."""
    return [tensor[t] for t in range(tensor.shape[0])] if sequence else [tensor]


def replay(run: Run, manifest: Manifest, tensor: np.ndarray | Sequence[np.ndarray], sequence: bool = False,
           metadata: Sequence[Mapping[str, Any]] | None = None) -> list[Outputs]:
    """Outputs of each step of one golden sample (one step) or sequence (state fed back between steps).

    `tensor`: the bundle's tensor for one frame ([1, ...]), a sequence ([T, 1, ...] with sequence=True),
    or a list of per-step tensors. A fresh state every call: replays never leak into each other.
    """
    steps = list(tensor) if isinstance(tensor, (list, tuple)) else steps_of(np.asarray(tensor), sequence)
    feeder = InputFeeder.for_manifest(manifest)
    outs: list[Outputs] = []
    for t, x in enumerate(steps):
        o = run(feeder.feeds(x, "replay", metadata=metadata[t] if metadata else None))
        feeder.advance("replay", o)
        outs.append(o)
    return outs


def stack_steps(outs: Sequence[Outputs]) -> Outputs:
    """Per-step outputs -> one array per output with the steps first ([T, ...]), the golden layout."""
    return {k: np.stack([o[k] for o in outs]) for k in outs[0]} if outs else {}


def is_sequence(g: Any) -> bool:
    """A golden sample that is a sequence of steps (a stateful bundle's), not one frame."""
    return bool(getattr(g, "sequence", False))


def golden_steps(outputs: Mapping[str, np.ndarray], sequence: bool,
                 axes: Mapping[str, int] | None = None) -> list[dict[str, np.ndarray]]:
    """One golden sample's outputs per step, batch dimension (on each output's batch axis) dropped: [1, ...] or
    [T, 1, ...]."""
    if not sequence:
        return [split_batch(outputs, 0, axes)]
    steps = next(iter(outputs.values())).shape[0]
    return [{k: v[t, 0] for k, v in outputs.items()} for t in range(steps)]


def run_golden(opened: Any, m: Any, tensor: np.ndarray, sequence: bool) -> list[dict[str, np.ndarray]]:
    """Outputs of each step of one golden sample through an open candidate, fed as serving feeds it (extra
    inputs, state)."""
    return replay(session_runner(opened.session), m, tensor, sequence=sequence)
