"""Driving a live audit by hand in tests: its clock stepped, a served frame handed to it each step."""

from __future__ import annotations

import numpy as np

from agent.proof.terms import SessionSettings
from agent.service.audit import AuditSettings, Auditor
from agent.serving.engine import Engine


def audited(engine: Engine, side: int, steps: int) -> Auditor:
    """An `Auditor` of `engine` after `steps` ten-second steps: each a canary due, then one served frame (a
    black `side` x `side` picture) judged against the reference (a window of two)."""
    now = [0.0]
    auditor = Auditor(AuditSettings(canary_period_s=1.0, live_period_s=1.0, live_window=2), lambda: engine,
                      SessionSettings(), clock=lambda: now[0])
    tensor = engine.preprocessor(np.zeros((side, side, 3), np.uint8))
    for step in range(1, steps + 1):
        now[0] = step * 10.0
        auditor._step()  # attach, then a canary each step
        auditor._live(tensor, engine.run(tensor))  # a served frame against the reference
    return auditor
