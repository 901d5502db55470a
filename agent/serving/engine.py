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
        return not isinstance(self.bundle.manifest.input.shape[0], int)

    def describe(self) -> dict[str, object]:
        m = self.bundle.manifest
        return {"bundle": m.name, "version": m.version, "label": m.label, "variant": self.candidate.variant,
                "provider": self.candidate.provider, "effective_providers": list(self.opened.effective)}


def build_engine(bundle: Bundle, candidate: Candidate, settings: SessionSettings) -> Engine:
    model = bundle.path(bundle.manifest.variant(candidate.variant).file)
    opened = open_session(model, candidate.provider, candidate.options, settings)
    return Engine(bundle, candidate, opened, bundle.preprocessor(), tuple(bundle.labels()))
