"""Review of issue 44 (third pass), served end to end: the real pipeline, the suite's stateful recurrence bundle
made 3.75x slower than real time (test_sensor_backlog's _Delay), real UDP senders. A stateful stream must be
served equal to the same stream served in real time, or the loss counted and the state reset (issue 44)."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import numpy as np

from tests.serving.test_sensor_backlog import WX, C, W, _Served, _stream, bundle, reference  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


def test_a_restarted_seq32_feeder_is_served_as_its_own_stream_by_a_slow_agent(bundle: Path) -> None:  # noqa: F811
    a, b = _stream(31, 20), _stream(32, 30)
    served = _Served(bundle, type="udp", host="127.0.0.1", port=0, framing="seq32").start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    port = served.source.port
    try:
        for x in (a, b):  # the feeder's first run, then its restart (a crash, its supervisor): numbers from 0
            for n in range(len(x) // W):
                tx.sendto(struct.pack("<I", n) + x[n * W:(n + 1) * W].astype("<f4").tobytes(), ("127.0.0.1", port))
                time.sleep(W / 32000 / 4)  # 4x real time
        h = served.source.streams_health  # type: ignore[attr-defined]
        assert wait_until(lambda: len(served.results()) * W + h()["lost_samples"] + h()["late_datagrams"] * W
                          >= len(a) + len(b), 60), (len(served.results()), h())
        time.sleep(0.5)
        res = served.results()
        assert len(res) >= 20
        mine = res[20:]
        spans = [r["result"]["stream"] for r in mine]
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in mine]) if mine else np.zeros((0, 3))
        want = reference(b)
        worst = float(np.abs(got - want[-len(got):]).max()) if len(got) else float("nan")
        assert len(mine) * W + h()["lost_samples"] == len(b) and (not mine or spans[0]["state"] != "carried"), (
            f"the restarted feeder's {len(b) // W} windows: {len(mine)} served, states {[s['state'] for s in spans][:3]}"
            f"..., sessions {sorted({s['session'] for s in spans})}, windows {spans[0]['window'] if spans else None}..; "
            f"late_datagrams {h()['late_datagrams']}, lost_samples {h()['lost_samples']}, restarts {h()['restarts']}; "
            f"served scores differ from the feeder's own stream by up to {worst:.3f}")
    finally:
        tx.close()
        served.close()


def test_one_window_with_non_finite_outputs_does_not_poison_the_rest_of_the_stream(bundle: Path) -> None:  # noqa: F811
    """docs/sensors.md: 'If a window of a stream still never runs (an inference error), the next one starts from
    the initial state and says so'. Window 5 holds finite but huge samples (garbage from a broken sender, +-3e38):
    the model's outputs overflow to NaN, and the pipeline drops that result (non_finite_output)."""
    x = _stream(33, 24)
    g = x.copy()
    # finite samples whose products overflow to +inf on channel 0 and -inf on channel 1: their sum is NaN
    big = np.finfo(np.float32).max
    sign = np.sign(WX[:, 0]).reshape(C, W).T  # the model's input is channel-major (ncw)
    g[5 * W:6 * W] = big * sign * np.array([1.0, -1.0], np.float32)
    served = _Served(bundle, type="udp", host="127.0.0.1", port=0).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for n in range(24):
            tx.sendto(g[n * W:(n + 1) * W].astype("<f4").tobytes(), ("127.0.0.1", served.source.port))
            time.sleep(W / 32000 / 4)
        m = served.pipeline.metrics
        assert wait_until(lambda: len(served.results()) + m.inference_errors >= 24, 30), (
            len(served.results()), m.inference_errors)
        time.sleep(0.3)
        res = served.results()
        spans = [r["result"]["stream"] for r in res]
        assert len(res) == 23 and spans[5]["window"] == 6 and spans[5]["state"].startswith("reset"), (
            f"{len(res)} of 24 windows served (windows {[s['window'] for s in spans]}), inference errors "
            f"{m.inference_errors}; states {[s['state'] for s in spans][:7]}")
        got = np.asarray([r["result"]["outputs"]["scores"]["values"] for r in res[5:]])
        assert float(np.abs(got - reference(x[6 * W:])).max()) < 1e-4
    finally:
        tx.close()
        served.close()


def test_a_window_whose_run_raised_is_a_hole_for_the_next_one() -> None:
    """docs/sensors.md: 'If a window of a stream still never runs (an inference error), the next one starts from
    the initial state and says so'. The engine calls feeds(), then session.run() (which raises here), and
    advance() only after a run that returned (agent/serving/engine.py _run)."""
    from agent.serving.stream_time import StreamSpan
    from agent.vocabulary.inputs import InputFeeder
    from agent.vocabulary.manifest import ExtraInput

    feeder = InputFeeder("x", (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    span = lambda k: StreamSpan("s", 1, k, k * 256, (k + 1) * 256, 256)  # noqa: E731
    for k in range(3):
        feeder.feeds(np.zeros(1), "s", span=span(k))
        if k != 1:  # window 1's run raised: no advance
            feeder.advance("s", {"hn": np.full((1, 4), k + 1, np.float32)})
    assert feeder.last_note != "carried", f"window 2 after the failed window 1: {feeder.last_note!r}"


def test_backlog_samples_counts_every_window_not_yet_served(bundle: Path) -> None:  # noqa: F811
    """docs/sensors.md: backlog_samples: 'samples delivered and not yet served'. A UDP sender sends 96 windows at
    once to the suite's stateful bundle made 3.75x slower than real time; while it works through them, health's
    backlog is compared with what was sent less what was served (published)."""
    x = _stream(34, 96)
    served = _Served(bundle, type="udp", host="127.0.0.1", port=0).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    health = served.source.streams_health  # type: ignore[attr-defined]
    try:
        for i in range(0, len(x), 8 * W):
            tx.sendto(x[i:i + 8 * W].astype("<f4").tobytes(), ("127.0.0.1", served.source.port))
        assert wait_until(lambda: len(served.results()) >= 20, 30)
        short = []
        for _ in range(10):
            n = len(served.results())
            (st,) = health()["streams"].values()
            n2 = len(served.results())
            if n == n2:  # nothing published meanwhile
                short.append(len(x) - n * W - st["backlog_samples"])
            time.sleep(0.05)
        assert short and max(short) <= W, (
            f"backlog_samples short of the samples not yet served by {sorted(set(short))} samples "
            f"({sorted({s // W for s in short})} windows of {W})")
    finally:
        tx.close()
        served.close()
