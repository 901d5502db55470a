"""Review of issue 44 point 4 (third pass): "source.sample_rate (and channel count, sample format) declared and
checked against the bundle's ... a mismatch that would change the answers is refused".

docs/sensors.md's own example under *Declared rates* declares `sample_dtype: int16` for a 16 kHz bundle such
as the worked example's Silero VAD (frame.dtype float32: samples in [-1, 1]). 16-bit PCM is taken as float32
values of -32768..32767, 32768 times too large, with neither `config check` nor the boot saying a word.
"""

from __future__ import annotations

import socket
import threading

import numpy as np

from agent.config import SourceConfig
from agent.errors import ConfigError
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=1.0),)
FRAME = {"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256, "dtype": "float32"}


def test_int16_pcm_declared_for_a_float32_bundle_is_refused_or_served_as_the_same_audio() -> None:
    from agent.serving.sensors import SensorSource, stream_problems

    frame = frame_from_dict(FRAME, STATE)
    cfg = SourceConfig(type="udp", host="127.0.0.1", port=0, sample_rate=16000, channels=1, sample_dtype="int16")
    problems = stream_problems(frame, STATE, [cfg], ["source"])
    try:
        src = SensorSource(cfg, frame)
    except ConfigError as exc:
        assert problems, f"the boot refused ({exc}) what config check accepted"
        return
    assert not problems, f"config check refused ({problems}) what the boot accepted"
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    try:
        audio = 0.5 * np.sin(np.arange(256) * 2 * np.pi * 440 / 16000)  # the same audio, as 16-bit PCM
        tx.sendto(np.round(audio * 32767).astype("<i2").tobytes(), ("127.0.0.1", src.port))
        got: list = []
        t = threading.Thread(target=lambda: got.append(src.read(stop)), daemon=True)
        t.start()
        assert wait_until(lambda: got, 10)
        win = got[0].data[:, 0]
        worst = float(np.abs(win - audio).max())
        assert worst < 1e-3, (f"config check: {problems or 'no problem'}; boot: accepted; the 0.5-amplitude sine was "
                              f"served with peak {float(np.abs(win).max()):.0f} (off by up to {worst:.0f})")
    finally:
        stop.set()
        tx.close()
        src.close()


def test_a_sender_at_half_the_declared_rate_is_reported_even_when_each_datagram_is_a_gap() -> None:
    """Issue 44's own case: 'a sender at half the declared rate (10 s of audio over 23 s) was served with no
    warning, because the gap rule restarts its clock at each late arrival'. Here each datagram holds 0.5 s of
    audio and comes 1 s after the last (8 kHz against a declared 16 kHz), reset_on_gap_s 0.2."""
    import time

    from agent.serving.sensors import SensorSource

    state = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=0.2),)
    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, sample_rate=16000),
                       frame_from_dict(FRAME, state))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        t0 = time.monotonic()
        for k in range(6):  # 8,000 samples every 1.0 s for 5 s: 8,000 samples/s
            delay = t0 + k * 1.0 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tx.sendto(np.zeros(8000, "<f4").tobytes(), ("127.0.0.1", src.port))
        time.sleep(0.5)
        h = src.streams_health()
        (s,) = h["streams"].values()
        assert "rate_off_by" in s, (f"5 s of a sender at half the declared rate: restarts {h['restarts']}, "
                                    f"session {s['session']}, measured_rate {s.get('measured_rate')}, no rate_off_by")
    finally:
        tx.close()
        src.close()
