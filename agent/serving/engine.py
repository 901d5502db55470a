"""An Engine is what serving needs from a self-test winner: the session, the bundle's pre/postprocessing.

Swapping engines (a new bundle) is one reference assignment; frames already preprocessed for the old
engine finish on it, so the stream never stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.bundle.load import Bundle
from agent.spec.preprocess import Preprocessor
from agent.proof.session import OpenedSession, open_session
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate


@dataclass(frozen=True)
class Engine:
    bundle: Bundle
    candidate: Candidate
    opened: OpenedSession
    preprocessor: Preprocessor
    labels: tuple[str, ...]

    @property
    def dynamic_batch(self) -> bool:
        """Frames may share a batch: a dynamic batch dimension, a fixed input size (fit_multiple makes the
        size follow each frame, so its frames run one at a time), and no state carried between frames."""
        m = self.bundle.manifest
        return not isinstance(m.input.shape[0], int) and self.preprocessor.fixed_size and not m.stateful

    def describe(self) -> dict[str, object]:
        m = self.bundle.manifest
        return {"bundle": m.name, "version": m.version, "label": m.label, "variant": self.candidate.variant,
                "provider": self.candidate.provider, "effective_providers": list(self.opened.effective)}


def build_engine(bundle: Bundle, candidate: Candidate, settings: SessionSettings) -> Engine:
    model = bundle.path(bundle.manifest.variant(candidate.variant).file)
    opened = open_session(model, candidate.provider, candidate.options, settings)
    return Engine(bundle, candidate, opened, bundle.preprocessor(), tuple(bundle.labels()))
