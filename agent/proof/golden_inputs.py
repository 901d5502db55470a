"""What a proof reads from the golden samples before any candidate runs: the device's own preprocessing against
the bundled tensors, each variant's recorded outputs (its reproduction reference), and the tensor the latency loop
times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from agent.bundle.load import Bundle, GoldenSample
from agent.npio import open_npz
from agent.proof.pre_compare import Levels, SampleDiff, compare, explain, lattice_levels
from agent.proof.replay import is_sequence
from agent.proof.stages import preprocessor_for
from agent.proof.verdict import PreprocessCheck
from agent.vocabulary.preprocess import Preprocessor

if TYPE_CHECKING:
    pass



def check_preprocessing(bundle: Bundle, golden: Sequence[GoldenSample]) -> tuple[PreprocessCheck, list[np.ndarray]]:
    """Run the device's preprocessing on each golden raw frame and compare with the bundled tensor: exact, the
    image library's rounding (agent.proof.pre_compare), or another preprocessing with the key that explains it."""
    pre = preprocessor_for(bundle)
    steps = pre.source_steps() if isinstance(pre, Preprocessor) else None
    levels = Levels(*steps) if steps is not None else None
    if not isinstance(pre, Preprocessor) and bundle.manifest.frame.kind == "image" and golden:
        # a pre graph keeps its scale, mean and std inside: one level is the grid its bundled tensor sits on (its
        # float Resize + Round moved 1-2 values a level on arm64); a tensor on no 8-bit grid stays exact
        levels = lattice_levels(golden[0].input)
    st = bundle.manifest.selftest
    worst: SampleDiff | None = None
    worst_i, tensors, rounding, explanation = 0, [], True, ""
    for g in golden:
        t = np.stack([pre(r) for r in g.raw]) if is_sequence(g) else pre(g.raw)
        tensors.append(t)
        d = compare(t, g.input, levels, st.preprocess_max_abs)
        refused = d.max_abs > st.preprocess_max_abs and not d.within(st.preprocess_rounding_levels)
        # beyond rounding, the worst refused sample is named with its own explanation (never one that only rounds)
        if refused and (rounding or worst is None or d.max_abs > worst.max_abs):
            rounding, explanation, worst, worst_i = False, explain(t, g.input, levels), d, g.index
        elif rounding and (worst is None or d.max_abs > worst.max_abs):
            worst, worst_i = d, g.index
    if worst is None:
        return PreprocessCheck(0.0, 0), tensors
    return PreprocessCheck(worst.max_abs, worst_i, worst.differing, worst.max_levels, worst.bias_levels,
                           rounding and worst.max_abs > st.preprocess_max_abs, explanation), tensors


def recorded_outputs(bundle: Bundle, variant: str,
                     golden: Sequence[GoldenSample] | None = None) -> list[dict[str, np.ndarray]] | None:
    """The variant's own outputs on each golden sample as `bundle create` recorded them
    (`variant.<name>.<output>`), or None when the bundle predates them (reproduction then falls
    back to the source references: `reproduction.against = "source"`). From `golden` when the samples
    are loaded already (they carry these arrays): each sample file is read once per proof, not once
    more per variant."""
    m = bundle.manifest
    if golden is not None:
        have = [g.variant_outputs.get(variant, {}) for g in golden]
        if not all(n in h for h in have for n in m.output_names):
            return None
        return [{n: h[n] for n in m.output_names} for h in have]
    out: list[dict[str, np.ndarray]] = []
    for rel in m.golden:
        with open_npz(bundle.path(rel)) as z:
            keys = {n: f"variant.{variant}.{n}" for n in m.output_names}
            if not all(k in z.files for k in keys.values()):
                return None
            out.append({n: z[k] for n, k in keys.items()})
    return out


def timing_tensor(golden: Sequence[GoldenSample]) -> np.ndarray:
    g = golden[0]
    return g.input[0] if is_sequence(g) else g.input
