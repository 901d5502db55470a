"""Stream identity and stream time for sensor sources, judged against a real stateful model's package.

Silero VAD (stateful: an LSTM state fed back every 512 samples) served by the agent's own sensor source,
pipeline and engine; each stream's per-window speech probabilities are compared with the package's own
wrapper (silero_vad OnnxWrapper, a fresh one per stream). Faults from issue 22: two UDP senders mixed
into one buffer and one state; a FIFO writer restart ending the agent; a gap reset keeping the dead
stream's samples; state reset at every burst of real-time windows (wall-clock gaps); windows of a stateful
stream dropped by latest-frame-wins hand-over.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sensor_streams import HOP, Served, build_vad_bundle, package_run, probability, send_chunks, speech
from waiting import end_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.real]  # a real model, its package in a subprocess, real-time senders

TOL = 1e-4  # the same model, the same feeds: only float reordering between the two runs


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sensor")


@pytest.fixture(scope="module")
def vad(work: Path) -> Path:
    return build_vad_bundle(work / "vad")


def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


def _stream_name(served: Served, sender: socket.socket) -> str:
    return f"{served.source.name}/127.0.0.1:{sender.getsockname()[1]}"


def _worst(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), f"{len(got)} windows served, the package scored {len(want)}"
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) if got else 0.0


def test_two_udp_senders_are_two_streams_each_equal_to_its_own_package_run(vad: Path, work: Path) -> None:
    a, b = speech(11, 2.0), speech(12, 2.0)
    want = package_run(work, [a, b])
    served = Served(vad, type="udp")
    sa, sb = _udp(), _udp()
    try:
        for i in range(0, len(a), HOP):  # interleaved datagrams: the old source mixed them into one window buffer
            sa.sendto(a[i:i + HOP].astype("<f4").tobytes(), ("127.0.0.1", served.port))
            sb.sendto(b[i:i + HOP].astype("<f4").tobytes(), ("127.0.0.1", served.port))
            time.sleep(0.002)
        n = len(a) // HOP
        assert wait_until(lambda: len(served.sink.results) >= 2 * n, 60), len(served.sink.results)
        for sender, ref in ((sa, want[0]), (sb, want[1])):
            name = _stream_name(served, sender)
            rs = served.results(name)
            assert [r["result"]["stream"]["window"] for r in rs] == list(range(n))
            assert all(r["source"] == name for r in rs)  # the per-stream name is the result's source
            worst = _worst([probability(r) for r in rs], ref["probabilities"])
            print(f"\n{name}: {len(rs)} windows, worst |p - package| {worst:.2e}")
            assert worst < TOL
        health = served.source.streams_health()
        assert set(health["streams"]) == {_stream_name(served, sa), _stream_name(served, sb)}
    finally:
        served.close()
        sa.close()
        sb.close()


def test_results_carry_the_stream_time_they_cover(vad: Path, work: Path) -> None:
    a = speech(13, 1.0)
    served = Served(vad, type="udp")
    s = _udp()
    try:
        send_chunks(s, served.port, a, pace_s=0.002)
        assert wait_until(lambda: len(served.sink.results) >= len(a) // HOP, 60)
        spans = [r["result"]["stream"] for r in served.sink.results]
        # window t: the 64 samples of context before 512 t, and its own 512 (16 kHz); the first one padded
        assert spans[0]["start_sample"] == -64 and spans[0]["end_sample"] == 512 and spans[0]["end_s"] == 0.032
        assert spans[5]["start_s"] == pytest.approx((5 * 512 - 64) / 16000) and spans[5]["end_s"] == pytest.approx(6 * 512 / 16000)
        assert spans[0]["state"] == "initial" and all(sp["state"] == "carried" for sp in spans[1:])
    finally:
        served.close()
        s.close()


def test_more_senders_than_max_streams_are_refused_and_counted(vad: Path) -> None:
    served = Served(vad, type="udp", max_streams=2)
    senders = [_udp() for _ in range(3)]
    a = speech(14, 0.5)
    try:
        for s in senders[:2]:
            send_chunks(s, served.port, a, pace_s=0.001)
        assert wait_until(lambda: len(served.sink.results) >= 2 * (len(a) // HOP), 60)
        send_chunks(senders[2], served.port, a, pace_s=0.001)
        assert wait_until(lambda: served.source.streams_health()["refused_datagrams"] == len(a) // HOP, 30)
        names = {r["source"] for r in served.sink.results}
        assert names == {_stream_name(served, s) for s in senders[:2]}
        from agent.link.health import ProcessProbe
        from agent.service.health_view import health_document

        doc = health_document(device_id="d", started=time.monotonic(), session=1, interval_s=1, serving=True,
                              not_serving_reason=None, engine=served.engine, pipeline=served.pipeline,
                              selftest_doc=None, outbox=None, probe=ProcessProbe(), operation=None)
        streams = doc["source"]["streams"]  # what health publishes: each stream by name, and the refusals
        assert set(streams["streams"]) == names and streams["max_streams"] == 2
        assert streams["refused_datagrams"] == len(a) // HOP
    finally:
        served.close()
        for s in senders:
            s.close()


WRITER = r"""
import sys, time
import numpy as np
audio = np.fromfile(sys.argv[2], "<f4")
upto = int(sys.argv[3])
with open(sys.argv[1], "wb", buffering=0) as f:
    for i in range(0, upto, 300):  # chunks that split samples and windows
        f.write(audio[i:min(i + 300, upto)].tobytes())
        time.sleep(0.001)
    print("written", flush=True)
    if upto < len(audio):
        time.sleep(3600)  # killed here, mid-stream
"""


def test_fifo_writer_killed_and_restarted_the_agent_keeps_serving_and_the_new_stream_equals_a_fresh_run(
        vad: Path, work: Path, tmp_path: Path) -> None:
    a, b = speech(15, 2.0), speech(16, 1.5)
    want_a, want_b = package_run(work, [a, b])
    fifo = tmp_path / "audio.fifo"
    os.mkfifo(fifo)
    files = []
    for name, x in (("a", a), ("b", b)):
        files.append(tmp_path / f"{name}.f32")
        x.astype("<f4").tofile(files[-1])
    served = Served(vad, type="file", path=fifo)
    cut = 20 * HOP + 300  # the killed writer leaves part of a window behind
    first = subprocess.Popen([sys.executable, "-c", WRITER, str(fifo), str(files[0]), str(cut)], stdout=subprocess.PIPE,
                             text=True)
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "written"
        assert wait_until(lambda: len(served.results(session=1)) == 20, 60), len(served.sink.results)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen([sys.executable, "-c", WRITER, str(fifo), str(files[1]), str(len(b))],
                                  stdout=subprocess.PIPE, text=True)
        assert second.wait(60) == 0  # the restarted feeder opened the FIFO (no ENXIO) and wrote all of it
        assert wait_until(lambda: len(served.results(session=2)) == len(b) // HOP, 60), len(served.sink.results)
        assert not served.pipeline.done.is_set()  # the agent did not end with the writer
        s1, s2 = served.results(session=1), served.results(session=2)
        assert _worst([probability(r) for r in s1], want_a["probabilities"][:20]) < TOL
        assert s2[0]["result"]["stream"]["state"].startswith("reset") and s2[0]["result"]["stream"]["window"] == 0
        worst = _worst([probability(r) for r in s2], want_b["probabilities"])
        print(f"\nafter the writer restart: {len(s2)} windows, worst |p - fresh package run| {worst:.2e}")
        assert worst < TOL
    finally:
        end_process(first, graceful=False)
        end_process(second, graceful=False)
        served.close()


def test_a_gap_reset_leaves_no_samples_of_the_old_stream(work: Path) -> None:
    bundle = build_vad_bundle(work / "vad-gap", reset_on_gap_s=0.3)
    a = speech(17, 1.0)[: 20 * HOP + 300]  # 300 samples left over: the old source started the next window with them
    b = speech(18, 1.0)
    (want_b,) = package_run(work, [b])
    served = Served(bundle, type="udp")
    s = _udp()
    try:
        send_chunks(s, served.port, a, chunk=HOP, realtime=True)
        assert wait_until(lambda: len(served.sink.results) == 20, 30)
        time.sleep(1.0)  # silence: 1 s of stream time with nothing, over reset_on_gap_s 0.3
        send_chunks(s, served.port, b, chunk=HOP, realtime=True)
        assert wait_until(lambda: len(served.results(session=2)) == len(b) // HOP, 30), len(served.sink.results)
        s2 = served.results(session=2)
        assert "gap" in s2[0]["result"]["stream"]["reset"] and s2[0]["result"]["stream"]["start_sample"] == -64
        worst = _worst([probability(r) for r in s2], want_b["probabilities"])
        assert worst < TOL, f"the stream after the gap differs from a fresh package run by {worst}"
        assert served.source.streams_health()["dropped_samples"] == 300  # the leftover no window served
    finally:
        served.close()
        s.close()


def test_real_time_bursts_longer_than_reset_on_gap_s_do_not_reset_the_state(work: Path) -> None:
    """Datagrams of 0.4 s sent in real time: windows come in bursts 0.4 s apart. Measured by the wall
    clock between windows (the old feeder), every burst reset the state; in stream time there is no gap."""
    bundle = build_vad_bundle(work / "vad-rt", reset_on_gap_s=0.3)
    a = speech(19, 2.4)
    (want,) = package_run(work, [a])
    served = Served(bundle, type="udp")
    s = _udp()
    try:
        send_chunks(s, served.port, a, chunk=6400, realtime=True)
        assert wait_until(lambda: len(served.sink.results) == len(a) // HOP, 30), len(served.sink.results)
        rs = served.results()
        assert all(r["result"]["stream"]["session"] == 1 for r in rs)
        assert all(r["result"]["stream"]["state"] == "carried" for r in rs[1:])
        assert _worst([probability(r) for r in rs], want["probabilities"]) < TOL
    finally:
        served.close()
        s.close()


def test_a_burst_on_a_stateful_udp_stream_loses_no_window(vad: Path, work: Path) -> None:
    """UDP's default hand-over is latest-frame-wins; a stateful bundle makes it lossless: a burst of
    windows faster than inference is served whole, in order (the old default served 2 of 10)."""
    a = speech(20, 1.0)
    (want,) = package_run(work, [a])
    served = Served(vad, type="udp")
    s = _udp()
    try:
        assert served.lossless
        send_chunks(s, served.port, a)  # as fast as the socket takes them
        n = len(a) // HOP
        assert wait_until(lambda: len(served.sink.results) == n, 30), len(served.sink.results)
        assert served.pipeline.drops == {}
        assert _worst([probability(r) for r in served.results()], want["probabilities"]) < TOL
    finally:
        served.close()
        s.close()


def test_a_window_dropped_in_a_stateful_stream_resets_the_state_and_says_so(vad: Path) -> None:
    from agent.serving.sensors import SensorFrame, StreamSpan

    from sensor_streams import engine_for

    eng = engine_for(vad)
    x = speech(21, 0.2)
    frames = []
    for t in range(4):
        span = StreamSpan("s", 1, t, t * HOP - 64, t * HOP + 512, HOP, 16000.0)
        frames.append(SensorFrame(t + 1, np.zeros((576, 1), np.float32) + x[t * HOP:t * HOP + 576, None], 0.0, 0, span))
    notes = []
    for f in (frames[0], frames[1], frames[3]):  # window 2 never ran
        eng.run(eng.preprocessor(f.data), f.source, 0.0, frame=f)
        notes.append(f.state)
    assert notes[:2] == ["initial", "carried"]
    assert notes[2] == "reset: 1 windows of the stream were not served"


def test_config_check_refuses_a_lossy_source_for_a_stateful_bundle_naming_both_keys(vad: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nbundle: {vad}\nsource: {{type: udp, port: 0, lossless: false}}\n")
    r = subprocess.run([sys.executable, "-m", "agent", "config", "check", str(cfg)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "source.lossless" in out and "kind: state" in out, out
