"""Review of issue 44 (third pass): docs/sensors.md's loss table says a gap, a writer that restarted and a sender
heard again after `stream_timeout_s` are 'counted in `restarts`, `dropped_samples`'. A FIFO writer's restart and a
UDP sender heard again after its time-out start new sessions (the state reset, said in the result) but `restarts`
stays 0: health does not count them."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until

W = 256
FRAME = {"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": W}
STATE = (ExtraInput("h", "state", "float32", (1, 4), from_output="hn", reset_on_gap_s=30.0),)


def _reader(src: Any, frames: list, stop: threading.Event) -> None:
    def run() -> None:
        while (f := src.read(stop)) is not None:
            f.settled()  # served, as the pipeline's publish stage says
            frames.append(f)

    threading.Thread(target=run, daemon=True).start()


def test_a_fifo_writers_restart_is_counted_in_restarts(tmp_path: Path) -> None:
    from agent.serving.sensors import SensorSource

    fifo = tmp_path / "s.fifo"
    os.mkfifo(fifo)
    src = SensorSource(SourceConfig(type="file", path=fifo), frame_from_dict(FRAME, STATE))
    frames: list = []
    stop = threading.Event()
    _reader(src, frames, stop)
    try:
        for k in range(2):  # two writers, one after the other; the first leaves half a window
            with open(fifo, "wb", buffering=0) as f:
                f.write(np.full(2 * W + (W // 2 if k == 0 else 0), k, "<f4").tobytes())
            assert wait_until(lambda: len(frames) >= 2 * (k + 1), 10), len(frames)
            time.sleep(0.3)
        h = src.streams_health()
        assert frames[2].span.session == 2 and frames[2].span.reset == "writer restarted"
        assert h["dropped_samples"] == W // 2
        assert h["restarts"] == 1, f"sessions {[f.span.session for f in frames]}; health restarts {h['restarts']}"
    finally:
        stop.set()
        src.close()


def test_a_udp_sender_heard_again_after_its_timeout_is_counted_in_restarts() -> None:
    from agent.serving.sensors import SensorSource

    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, stream_timeout_s=0.5),
                       frame_from_dict(FRAME, STATE))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    frames: list = []
    stop = threading.Event()
    _reader(src, frames, stop)
    try:
        tx.sendto(np.zeros(W + W // 2, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: frames and not src.streams_health()["streams"], 10)  # timed out
        tx.sendto(np.zeros(W, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: len(frames) >= 2, 10)
        h = src.streams_health()
        assert frames[1].span.session == 2 and frames[1].span.reset.startswith("sender heard again")
        assert h["dropped_samples"] == W // 2
        assert h["restarts"] == 1, f"sessions {[f.span.session for f in frames]}; health restarts {h['restarts']}"
    finally:
        stop.set()
        tx.close()
        src.close()


def test_a_sender_heard_again_after_many_others_goes_on_as_its_next_session() -> None:
    """docs/sensors.md: 'A sender heard again after its stream timed out goes on as the next session of its stream
    (session 2, reset: sender heard again after it was quiet ...)'. max_streams 1: the source remembers 4 quiet
    senders; 5 others come and go before A is heard again."""
    from agent.serving.sensors import SensorSource
    from agent.vocabulary.inputs import InputFeeder

    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, max_streams=1, stream_timeout_s=0.1),
                       frame_from_dict(FRAME, STATE))
    feeder = InputFeeder("x", STATE)
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    frames: list = []
    notes: list = []
    stop = threading.Event()

    def run() -> None:  # as the engine does
        while (f := src.read(stop)) is not None:
            f.settled()  # served, as the pipeline's publish stage says
            feeder.feeds(np.zeros(1), f.span.stream, span=f.span)
            feeder.advance(f.span.stream, {"hn": np.ones((1, 4), np.float32)})
            frames.append(f)
            notes.append(feeder.last_note)

    threading.Thread(target=run, daemon=True).start()
    try:
        a.sendto(np.zeros(3 * W, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: len(frames) >= 3, 10)
        for k in range(5):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as o:
                assert wait_until(lambda: not src.streams_health()["streams"], 10)  # the last one timed out
                o.sendto(np.zeros(W, "<f4").tobytes(), ("127.0.0.1", src.port))
                assert wait_until(lambda: len(frames) >= 4 + k, 10)
        assert wait_until(lambda: not src.streams_health()["streams"], 10)
        a.sendto(np.zeros(W, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: len(frames) >= 9, 10)
        back = frames[-1]
        assert back.span.session == 2 and notes[-1].startswith("reset: sender heard again"), (
            f"A heard again: session {back.span.session} window {back.span.window}, state {notes[-1]!r}")
    finally:
        stop.set()
        a.close()
        src.close()
