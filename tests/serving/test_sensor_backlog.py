"""A stateful stream served by an agent slower than the stream: the backlog is never a gap, every loss is
counted and said, the rates and channels declared are checked, and the agent says how far behind it is.

A small stateful model (a tanh recurrence, as tests/proof/test_stateful.py's) built into a real bundle and served
by the real pipeline, made slower than real time by a delay before each inference (the engine's `watch`
hook, where serving's crash marker sits): 30 ms per window of 8 ms of audio, 3.75x slower than real time.
Faults from issue 44: a stream written at once to stdin or a FIFO reset its state at every pipe buffer
(the agent's read time was taken for the writer's), a UDP sender faster than real time likewise at every
datagram, and datagrams the socket dropped were neither counted nor a reset.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.serving.sensors import SEQ  # the seq32 framing's header
import yaml

from agent.config import PipelineConfig, SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

W, C, H, K = 256, 2, 6, 3  # window (= hop), channels, state width, outputs
SR = 32000  # 8 ms of audio per window
DELAY_S = 0.03  # each inference waits this long first: the agent is 3.75x slower than the stream
N = 96  # windows per test stream: 3 pipe buffers of 64 KiB, 6 datagrams of 16 windows
rng0 = np.random.default_rng(44)
WX = (rng0.standard_normal((C * W, H)) * 0.05).astype(np.float32)
U = (rng0.standard_normal((H, H)) * 0.6).astype(np.float32)
V = (rng0.standard_normal((H, K)) * 1.5).astype(np.float32)


def _model(path: Path) -> Path:
    from sensor_streams import recurrence_model

    return recurrence_model(path, (C, W), WX, U, V)


def reference(stream: np.ndarray) -> np.ndarray:
    """scores of every window of one session from the stream's start: what real time serves."""
    s = np.zeros(H, np.float64)
    out = []
    for w in stream.reshape(-1, W, C):
        s = np.tanh(w.T.reshape(-1) @ WX + s @ U)
        out.append(s @ V)
    return np.asarray(out)


def _stream(seed: int, windows: int = N) -> np.ndarray:
    t = np.arange(windows * W, dtype=np.float32)[:, None]
    rng = np.random.default_rng(seed)
    return (np.sin(t * rng.uniform(0.01, 0.2, C)) + rng.normal(0, 0.3, (len(t), C))).astype(np.float32)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    d = tmp_path_factory.mktemp("stateful-stream")
    spec = {"name": "stateful-stream", "version": 1, "label": "0.1.0", "task": "raw",
            "frame": {"kind": "sensor", "window": W, "channels": C, "dtype": "float32", "sample_rate": SR},
            "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": 0.0,
                        "from_output": "stateN", "reset_on_gap_s": 0.2}],
            "preprocess": {"layout": "ncw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": K}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    seqs = np.stack([_stream(s, 12).reshape(12, W, C) for s in range(6)])
    np.savez(d / "golden.npz", raw=seqs)
    return create_bundle(CreateOptions(model=_model(d / "model.onnx"), spec=d / "spec.yaml", calibration=d / "golden.npz",
                                       golden=d / "golden.npz", out=d / "bundle", int8=False))


class _Delay:
    """The engine's watch hook, slowing every inference (a busy device)."""

    def before(self) -> None:
        time.sleep(DELAY_S)

    def after(self, outputs: Any) -> Any:
        return outputs

    def abandon(self) -> None:
        pass


class _Served:
    def __init__(self, bundle: Path, **source: Any):
        from agent.bundle.load import load_bundle
        from agent.proof.terms import CPU, SessionSettings
        from agent.proof.verdict import Candidate
        from agent.serving.engine import build_engine
        from agent.serving.pipeline import Pipeline
        from agent.serving.sources import is_lossless, open_source
        from agent.testing import ListSink

        b = load_bundle(bundle)
        engine = build_engine(b, Candidate(CPU, "fp32", "fp32"), SessionSettings(intra_op_threads=1))
        self.engine = dataclasses.replace(engine, watch=_Delay())
        cfg = SourceConfig(**source)
        self.source = open_source(cfg, b.manifest.frame)
        self.sink = ListSink()
        self.pipeline = Pipeline(self.source, self.engine, self.sink, PipelineConfig(inference_workers=1, max_batch=1),
                                 is_lossless(cfg, self.source))

    def start(self) -> "_Served":
        self.pipeline.start()
        return self

    def results(self) -> list[dict[str, Any]]:
        return list(self.sink.results)

    def close(self) -> None:
        self.pipeline.stop()
        self.pipeline.join(timeout=15)
        self.source.close()


def _assert_one_session_equal_to_real_time(results: list[dict[str, Any]], stream: np.ndarray) -> None:
    want = reference(stream)
    spans = [r["result"]["stream"] for r in results]
    resets = [(s["window"], s["state"]) for s in spans if s["state"] not in ("initial", "carried")]
    assert resets == [], f"the state was reset at {resets}"
    assert [(s["session"], s["window"]) for s in spans] == [(1, k) for k in range(len(want))]
    got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in results])
    worst = float(np.abs(got - want).max())
    assert worst < 1e-4, f"served windows differ from the stream served in real time by up to {worst}"


def _write_all(path: str | int, data: bytes) -> threading.Thread:
    """A writer that writes the whole stream at once (blocked by the full pipe), then closes."""
    def run() -> None:
        with open(path, "wb", buffering=0) as f:  # closed at the end: the reader sees end-of-file
            f.write(data)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_stream_written_to_stdin_at_once_is_served_whole_by_a_slower_agent(bundle: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each 64 KiB pipe buffer read late by the busy agent was a 'gap' of stream time: reset."""
    x = _stream(1)
    r, w = os.pipe()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(os.fdopen(r, "rb")))
    served = _Served(bundle, type="stdin").start()
    writer = _write_all(w, x.astype("<f4").tobytes())
    try:
        assert served.pipeline.done.wait(60), len(served.results())
        writer.join(10)
        _assert_one_session_equal_to_real_time(served.results(), x)
    finally:
        served.close()


def test_a_stream_written_to_a_fifo_at_once_is_served_whole_by_a_slower_agent(bundle: Path, tmp_path: Path) -> None:
    """Before: a reset every pipe buffer although the writer never paused (it was blocked on the full pipe)."""
    x = _stream(2)
    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    served = _Served(bundle, type="file", path=fifo)
    try:
        served.pipeline.paused.set()  # behind from the start: the writer fills the pipe and waits
        served.start()
        _write_all(str(fifo), x.astype("<f4").tobytes())
        health = served.source.streams_health  # type: ignore[attr-defined]
        # what waits in the pipe is the agent's backlog too (64 KiB: 32 windows of 8 ms)
        assert wait_until(lambda: health()["streams"][served.source.name]["backlog_samples"] >= 32 * W, 10)
        served.pipeline.paused.clear()
        assert wait_until(lambda: len(served.results()) >= N, 60), len(served.results())
        _assert_one_session_equal_to_real_time(served.results(), x)
    finally:
        served.close()


def test_a_udp_sender_at_4x_real_time_is_served_whole_by_a_slower_agent_which_says_how_far_behind(
        bundle: Path) -> None:
    """Before: each datagram (16 windows, 128 ms) read once the agent had served the previous one, 480 ms
    later, was a 'gap' of 352 ms > reset_on_gap_s 0.2: the state reset at every datagram."""
    x = _stream(3)
    served = _Served(bundle, type="udp", host="127.0.0.1", port=0)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    per = 16 * W  # samples per datagram
    try:
        served.pipeline.paused.set()  # the agent is behind from the start: nothing served until resumed
        served.start()
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(x), per)):
            delay = t0 + k * per / SR / 4 - time.monotonic()  # 4x real time, against an absolute schedule
            if delay > 0:
                time.sleep(delay)
            tx.sendto(x[i:i + per].astype("<f4").tobytes(), ("127.0.0.1", served.source.port))
        health = served.source.streams_health  # type: ignore[attr-defined]
        assert wait_until(lambda: sum(s["backlog_samples"] for s in health()["streams"].values()) == len(x), 10)
        (stream,) = health()["streams"].values()
        assert stream["backlog_s"] == pytest.approx(len(x) / SR) and stream["oldest_unserved_age_s"] > 0
        assert health()["behind_s"] == stream["oldest_unserved_age_s"] or health()["behind_s"] > 0
        served.pipeline.paused.clear()
        assert wait_until(lambda: len(served.results()) >= N, 60), len(served.results())
        _assert_one_session_equal_to_real_time(served.results(), x)
        assert health()["lost_samples"] == 0 and health()["lost_datagrams"] == 0
        assert wait_until(lambda: next(iter(health()["streams"].values()))["backlog_samples"] == 0, 10)
    finally:
        tx.close()
        served.close()


@pytest.mark.slow
@pytest.mark.idle  # mostly waits for paho's reconnect after the broker's restart
def test_mqtt_samples_into_a_stateful_bundle_are_served_whole_and_a_lost_connection_resets_saying_so(
        bundle: Path, tmp_path: Path) -> None:
    """Before: MQTT into a stateful bundle was latest-frame-wins whole windows: windows dropped as stale and
    the state carried across the holes, results without a stream or a state."""
    import paho.mqtt.client as paho

    from brokers import Broker

    broker = Broker(tmp_path / "broker").start()
    x, y = _stream(4), _stream(5)
    topic, per = "audio/mic", 16 * W
    # numbered payloads (framing: seq32): unnumbered MQTT samples into a stateful bundle are refused
    served = _Served(bundle, type="mqtt", host="127.0.0.1", port=broker.port, topic=topic, payload="samples",
                     framing="seq32").start()
    seq = iter(range(1 << 32))
    numbered = lambda chunk: SEQ.pack(next(seq)) + chunk.astype("<f4").tobytes()  # noqa: E731
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2)
    pub.reconnect_delay_set(1, 2)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    bad = lambda: served.pipeline.metrics.bad_frames  # noqa: E731
    try:
        # a barrier, not a pause: a retained payload that is not whole samples is counted once subscribed
        pub.publish(topic, b"bad", qos=1, retain=True).wait_for_publish(30)
        assert wait_until(lambda: bad() >= 1, 30), "the source never subscribed"
        for i in range(0, len(x), per):  # the whole stream at once: the agent is 3.75x slower than it
            pub.publish(topic, numbered(x[i:i + per]), qos=1)
        assert wait_until(lambda: len(served.results()) >= N, 60), len(served.results())
        _assert_one_session_equal_to_real_time(served.results(), x)
        broker.stop()  # the connection is lost: what is published meanwhile never arrives
        broker.start()
        assert wait_until(lambda: bad() >= 2 and pub.is_connected(), 60), "the source never subscribed again"
        for i in range(0, len(y), per):
            pub.publish(topic, numbered(y[i:i + per]), qos=1)
        assert wait_until(lambda: len(served.results()) >= 2 * N, 60), len(served.results())
        after = served.results()[N:]
        first = after[0]["result"]["stream"]
        assert (first["session"], first["window"]) == (2, 0)
        assert first["state"] == ("reset: the MQTT connection was lost: samples published meanwhile were not "
                                  "delivered")
        assert all(r["result"]["stream"]["state"] == "carried" for r in after[1:])
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in after])
        assert float(np.abs(got - reference(y)).max()) < 1e-4
        assert served.source.stats.losses == 1  # type: ignore[attr-defined]
    finally:
        pub.loop_stop()
        pub.disconnect()
        served.close()
        broker.stop()


def _sensor_source(**cfg: Any) -> Any:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    return SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, **cfg), frame)


def _queued_bytes(port: int) -> int:
    """Bytes waiting in the receive queue of the UDP socket bound to `port` (/proc/net/udp's rx_queue)."""
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port:
            return int(f[4].split(":")[1], 16)
    raise AssertionError(f"no UDP socket on port {port}")


def test_datagrams_the_receive_buffer_had_no_room_for_are_counted_and_the_state_resets_at_the_hole() -> None:
    """Before: the kernel's drops were never read, and the state was carried across the hole."""
    from agent.vocabulary.inputs import InputFeeder

    src = _sensor_source(receive_buffer_bytes=4096)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    feeder = InputFeeder("x", (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    stop = threading.Event()
    sent = 0

    def send(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            tx.sendto(np.full(256, sent, "<f4").tobytes(), ("127.0.0.1", src.port))
            sent += 1

    def served(n: int) -> list[Any]:
        out = []
        for _ in range(n):
            f = src.read(stop)
            feeder.feeds(np.zeros(1), f.span.stream, span=f.span)
            feeder.advance(f.span.stream, {"hn": np.ones((1, 4), np.float32)})
            out.append((f.span, feeder.last_note, int(f.data[0, 0])))
        return out

    try:
        send(2)
        first = served(2)
        with src._cond:  # the receiving thread is held (a busy CPU): the kernel queues, then drops
            send(60)
        # once the thread emptied the socket, two more: queued after the drops, they carry the kernel's count
        assert wait_until(lambda: _queued_bytes(src.port) == 0, 10)
        send(2)
        (stream,) = src.streams.values()
        assert wait_until(lambda: stream.received // 256 + src.lost_datagrams == sent, 10)
        lost = src.lost_datagrams
        assert lost > 0, "the socket dropped nothing: the test did not overflow it"
        rest = served(sent - 2 - lost)
        hole = [k for k, (_, _, v) in enumerate(rest) if v != k + 2]  # datagram numbers jump at the hole
        assert len(hole) >= 1
        at = hole[0]
        span, note, _ = rest[at]
        assert (span.session, span.window) == (2, 0)
        assert note == f"reset: {lost * 256:,} samples lost ({lost} datagrams dropped by the socket: its receive " \
                       "buffer was full)"
        assert [n for _, n, _ in first + rest[:at]] == ["initial"] + ["carried"] * (1 + at)
        assert all(n == "carried" for _, n, _ in rest[at + 1:])
        h = src.streams_health()
        assert h["lost_datagrams"] == lost and h["lost_samples"] == lost * 256 and h["restarts"] == 1
        assert h["streams"][span.stream]["lost_samples"] == lost * 256
    finally:
        tx.close()
        src.close()


# Timed against the kernel's receive timestamps and a held receiving thread: under a loaded parallel lane (load 20
# and more on 2 cores) a scheduler delay of a second between the sends reads as a gap; run alone (serial lane).
@pytest.mark.slow
@pytest.mark.serial
def test_with_two_senders_a_socket_drop_resets_both_streams_as_it_cannot_say_whose_datagrams_it_dropped() -> None:
    src = _sensor_source(receive_buffer_bytes=4096)
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    stop = threading.Event()
    try:
        for tx in (a, b):
            tx.sendto(np.zeros(256, "<f4").tobytes(), ("127.0.0.1", src.port))
        before = [src.read(stop) for _ in range(2)]
        with src._cond:  # the receiving thread is held: a's burst overflows the socket
            for _ in range(60):
                a.sendto(np.ones(256, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: _queued_bytes(src.port) == 0, 10)
        for tx in (b, a):  # queued after the drops: the first carries the kernel's count
            tx.sendto(np.full(256, 2.0, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: sum(s.received for s in src.streams.values()) // 256 + src.lost_datagrams == 64, 10)
        lost = src.lost_datagrams
        assert lost > 0, "the socket dropped nothing: the test did not overflow it"
        after = [src.read(stop) for _ in range(64 - lost - 2)]
        why = f"{lost} datagrams dropped by the socket: its receive buffer was full, from any of 2 senders"
        for tx in (a, b):
            mine = [f for f in before + after if f.span.sender == f"127.0.0.1:{tx.getsockname()[1]}"]
            assert [f.span.session for f in mine] == [1] * (len(mine) - 1) + [2], [f.span.reset for f in mine]
            assert mine[-1].span.reset == why and mine[-1].data[0, 0] == 2.0
        assert src.streams_health()["lost_datagrams"] == lost
    finally:
        a.close()
        b.close()
        src.close()


def test_a_backlog_beyond_max_backlog_s_is_shed_counted_and_the_stream_starts_again_at_the_newest_audio() -> None:
    """The window dropped to keep up: counted as lost samples and said by the next window, never carried over."""
    src = _sensor_source(max_backlog_s=0.1)  # 1,600 samples at 16 kHz
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    try:
        for k in range(10):  # nothing is read meanwhile: the 7th datagram takes the backlog to 1,792
            tx.sendto(np.full(256, k, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: sum(s.received for s in src.streams.values()) == 2560, 10)
        frames = [src.read(stop) for _ in range(3)]
        assert [(f.span.session, f.span.window, int(f.data[0, 0])) for f in frames] == [(2, 0, 7), (2, 1, 8), (2, 2, 9)]
        assert frames[0].span.reset == "1,792 samples lost (the agent was more than source.max_backlog_s 0.1 s behind)"
        for f in frames:
            f.settled()  # served, as the pipeline's publish stage says
        h = src.streams_health()
        assert (h["lost_samples"], h["restarts"]) == (1792, 1)
        assert h["streams"][frames[0].span.stream]["backlog_samples"] == 0
    finally:
        tx.close()
        src.close()


def test_a_gap_in_a_senders_sequence_numbers_is_counted_and_resets_that_stream_only() -> None:
    """framing: seq32: the sender numbers its datagrams; lost ones are a hole of exactly their samples in
    their own stream, a late one is counted and dropped (its place in the stream was taken)."""
    import struct

    src = _sensor_source(framing="seq32")
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    stop = threading.Event()
    try:
        for tx, numbers in ((a, (0, 1, 2, 5, 6, 4)), (b, (0, 1, 2, 3, 4))):  # a: 3 and 4 lost, then 4 late
            for n in numbers:
                tx.sendto(struct.pack("<I", n) + np.full(256, n, "<f4").tobytes(), ("127.0.0.1", src.port))
        frames = [src.read(stop) for _ in range(10)]  # b's last datagram came after a's late one
        by = {tx: [f for f in frames if f.span.sender == f"127.0.0.1:{tx.getsockname()[1]}"] for tx in (a, b)}
        assert [(f.span.session, f.span.window, int(f.data[0, 0])) for f in by[a]] == [
            (1, 0, 0), (1, 1, 1), (1, 2, 2), (2, 0, 5), (2, 1, 6)]
        assert by[a][3].span.reset == "512 samples lost (2 datagrams missing: sequence 3 to 4)"
        assert [(f.span.session, f.span.reset, int(f.data[0, 0])) for f in by[b]] == [(1, None, n) for n in range(5)]
        h = src.streams_health()
        assert (h["lost_datagrams"], h["lost_samples"], h["late_datagrams"], h["restarts"]) == (2, 512, 1, 1)
    finally:
        a.close()
        b.close()
        src.close()


def test_a_declared_16_khz_stream_sent_at_8_khz_is_reported() -> None:
    """Before: a sender at half the rate was served with no word (the gap rule restarted its clock)."""
    src = _sensor_source()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        t0 = time.monotonic()
        for k in range(50):  # 400 samples every 50 ms: 8,000 samples/s for 2.5 s
            delay = t0 + k * 0.05 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tx.sendto(np.zeros(400, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: any("measured_rate" in s for s in src.streams_health()["streams"].values()), 10)
        (s,) = src.streams_health()["streams"].values()
        # reported as slow (about 0.5; the bound leaves room for a late first datagram on a busy machine)
        assert s["measured_rate"] < 12000 and s["rate_off_by"] < 0.75
    finally:
        tx.close()
        src.close()


def test_a_declared_rate_or_channel_count_the_bundle_does_not_take_is_refused_naming_the_key() -> None:
    from agent.errors import ConfigError
    from agent.serving.sensors import stream_problems

    with pytest.raises(ConfigError, match=r"key source\.sample_rate: the senders send 8000 samples/s but the "
                                          r"bundle's frame takes 16000 samples/s"):
        _sensor_source(sample_rate=8000)
    with pytest.raises(ConfigError, match=r"key source\.channels: the senders send 2 channels but the bundle's "
                                          r"frame takes 1"):
        _sensor_source(channels=2)
    _sensor_source(sample_rate=16000, channels=1).close()  # declared as the bundle takes: served
    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256})
    assert stream_problems(frame, (), [SourceConfig(type="stdin", sample_rate=48000)], ["sources[0]"]) == [
        "key sources[0].sample_rate: the senders send 48000 samples/s but the bundle's frame takes 16000 samples/s "
        "(input.frame.sample_rate): resample before sending, or serve a bundle built for this rate"]


def test_config_check_and_boot_refuse_mqtt_for_a_stateful_bundle_in_one_line(bundle: Path, tmp_path: Path) -> None:
    """Before: accepted; windows were dropped as stale and the state carried across the holes."""
    import subprocess

    from agent.bundle.load import load_bundle
    from agent.errors import ConfigError
    from agent.serving.sources import open_source

    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nbundle: {bundle}\n"
                   "source: {type: mqtt, topic: audio, payload: raw}\n")
    r = subprocess.run([sys.executable, "-m", "agent", "config", "check", str(cfg)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "source.type: mqtt cannot keep" in ln]
    assert len(lines) == 1, r.stdout + r.stderr
    with pytest.raises(ConfigError, match=r"key source\.type: mqtt cannot keep a stateful bundle's contract"):
        open_source(SourceConfig(type="mqtt", topic="audio", payload="raw"), load_bundle(bundle).manifest.frame)


# Timed against the kernel's receive timestamps and a held receiving thread: under a loaded parallel lane (load 20
# and more on 2 cores) a scheduler delay of a second between the sends reads as a gap; run alone (serial lane).
@pytest.mark.slow
@pytest.mark.serial
def test_a_datagram_read_late_keeps_the_time_the_kernel_received_it() -> None:
    """What makes a busy agent's late read no gap on UDP: the arrival is the kernel's (SO_TIMESTAMPNS)."""
    from agent.serving.udp_receive import Datagrams

    rx, tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5)
        d = Datagrams(rx)
        tx.sendto(b"12345678", rx.getsockname())
        assert wait_until(lambda: _queued_bytes(rx.getsockname()[1]) > 0, 10)  # queued by the kernel
        time.sleep(0.5)  # the agent busy elsewhere: the datagram waits
        read_at = time.time()
        got = d.receive()
        assert d.exact and got.data == b"12345678" and got.dropped == 0
        assert got.arrival < read_at - 0.4, f"arrival {read_at - got.arrival:.3f} s before the read"
    finally:
        rx.close()
        tx.close()
