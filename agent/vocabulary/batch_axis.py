"""Outputs whose batch axis is not the first: `outputs[].batch_axis` in the manifest, `outputs.<name>.batch_axis`
in a `bundle create` spec.

Some models put the batch on another axis, most often CTC text recognisers exported time-major (`[T, B, C]`,
PyTorch's RNN default). Taking axis 0 as the batch hands the decoder one time step; the declaration says which
axis is the batch, with no edit of the model. Everything that takes one frame's outputs out of a batch
(serving's publish stage, the self-test, the audit, `bundle create`) slices on that axis
(`agent.vocabulary.decoders.split_batch` with the manifest's `batch_axes`); a post graph receives the slice
batch-first (`[1, T, C]`), so the recipes written for batch-first heads (`post.ctc`) serve time-major ones as
they are. Recorded outputs (golden `reference.<output>`, `variant.<name>.<output>`) keep the model's own layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from agent.errors import BundleError

SPEC_KEY = "outputs"


def batch_size(outputs: Mapping[str, np.ndarray], axes: Mapping[str, int] | None = None) -> int:
    """The number of samples in batched outputs: the size of the first output's batch axis."""
    if not outputs:
        return 0
    name, first = next(iter(outputs.items()))
    return int(first.shape[(axes or {}).get(name, 0)])


def spec_batch_axes(spec: Mapping[str, Any], outputs: list[dict[str, Any]], where: object) -> dict[str, int]:
    """The `outputs.<name>.batch_axis` declarations of a `bundle create` spec, checked against the model's outputs
    (a name the model lacks, an axis it does not have); `outputs` (the model's contract) gains each one."""
    declared = spec.get(SPEC_KEY) or {}
    if not isinstance(declared, Mapping):
        raise BundleError(f"{where}: key {SPEC_KEY}: a mapping of output name to {{batch_axis: N}}, got {declared!r}")
    by_name = {o["name"]: o for o in outputs}
    axes: dict[str, int] = {}
    for name, d in declared.items():
        if name not in by_name:
            raise BundleError(f"{where}: key {SPEC_KEY}.{name}: the model has no output {name!r} "
                              f"(outputs: {sorted(by_name)})")
        unknown = set(d or {}) - {"batch_axis"}
        if unknown or not isinstance((d or {}).get("batch_axis"), int) or isinstance(d["batch_axis"], bool):
            raise BundleError(f"{where}: key {SPEC_KEY}.{name}: takes only batch_axis, an integer axis "
                              f"(got {d!r})")
        axis, rank = d["batch_axis"], len(by_name[name]["shape"])
        if not 0 <= axis < rank:
            raise BundleError(f"{where}: key {SPEC_KEY}.{name}.batch_axis: {axis} is not an axis of output {name!r} "
                              f"(shape {by_name[name]['shape']} as the model declares it)")
        if axis:
            by_name[name]["batch_axis"] = axis
            axes[name] = axis
    return axes


def spec_axes(spec: Mapping[str, Any]) -> dict[str, int]:
    """The non-zero batch axes a spec declares (checked by spec_batch_axes when the build reads the model)."""
    declared = spec.get(SPEC_KEY) or {}
    return {str(k): int(v["batch_axis"]) for k, v in declared.items()
            if isinstance(v, Mapping) and v.get("batch_axis")} if isinstance(declared, Mapping) else {}


def check_single_sample_outputs(outputs: Mapping[str, np.ndarray], axes: Mapping[str, int], where: object) -> None:
    """One frame's outputs must have size 1 on their batch axis; an output whose axis 0 is longer while another
    axis is 1 is time-major (or otherwise batch-second): refused naming the key that states it, never served as
    its slice at axis 0 (one time step)."""
    for name, v in outputs.items():
        axis = axes.get(name, 0)
        if v.ndim == 0 or v.shape[axis] == 1:
            continue
        ones = [i for i, n in enumerate(v.shape) if n == 1]
        hint = (f"declare `{SPEC_KEY}.{name}.batch_axis: {ones[0]}` in the spec (manifest outputs[].batch_axis)"
                if ones else "the output has no axis of size 1 to be the batch; re-export it with a batch axis")
        key = f"{SPEC_KEY}.{name}.batch_axis" + ("" if name in axes else " (default 0)")
        raise BundleError(f"{where}: output {name!r} of one frame has shape {list(v.shape)}: its batch axis "
                          f"({key}: {axis}) is {v.shape[axis]} long, so each frame would be served one slice of "
                          f"another axis; {hint}")
