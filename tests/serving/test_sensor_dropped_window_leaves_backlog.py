"""Review of issue 44 (44r), the newest change (0125692): a window stays in its stream's backlog_samples until
its result is published or it is dropped. docs/sensors.md: "a window leaves the backlog when its result is
published or it is dropped ... Both are 0 while no window of the stream waits or is being served".

A stateless sensor bundle (the suite's tiny one) over UDP: a live source, so the pipeline hands windows over
latest-frame-wins. Two senders share the socket (each its own stream). Sender A's second window waits in the
hand-over and sender B's window replaces it there: A's window is dropped (counted `stale`, for the pipeline as
a whole), but nothing tells A's stream, and A sends nothing more. 0125692 settles a dropped window only "with
the next" result of its stream; an idle stream has none: its backlog_samples and oldest_unserved_age_s (and
the source's behind_s) stay up and grow while the agent is idle and has served or dropped every window.
Issue 44 (2): "every loss (... windows dropped to keep up) counted per stream in health": A's stream counts
nothing of the window it lost either."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np

from gated_pipeline import Gate, Gated
from waiting import wait_until


def _a_window_of_a_dropped_for_bs(bundle: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A's second window dropped in the hand-over for B's; once the pipeline is done: A's stream's health and
    the source's."""
    gate = Gate()
    served = Gated(bundle, gate, type="udp", host="127.0.0.1", port=0)
    assert not served.pipeline.lossless  # live: latest-frame-wins
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    rng = np.random.default_rng(7)
    win = lambda: rng.normal(0, 1, (64, 3)).astype("<f4").tobytes()  # noqa: E731 (one window of the bundle)
    try:
        served.start()
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
        to = ("127.0.0.1", served.source.port)
        name = {s: f"{served.source.name}/127.0.0.1:{s.getsockname()[1]}" for s in (a, b)}
        m, drops = served.pipeline.metrics, served.pipeline.drops
        a.sendto(win(), to)  # A's first window: taken, its inference held at the gate
        assert gate.reached.wait(30)
        a.sendto(win(), to)  # A's second: read, waits in the hand-over
        assert wait_until(lambda: m.frames_in >= 2, 30), m.frames_in
        b.sendto(win(), to)  # B's first replaces it there: A's second window dropped
        assert wait_until(lambda: drops.get("stale", 0) >= 1, 30), drops
        gate.open.set()
        # B's window published (and settled): everything the pipeline took is done with
        assert wait_until(lambda: len(served.results()) >= 2 and name[b] in served.streams()
                          and served.streams()[name[b]]["backlog_samples"] == 0, 30), served.streams()
        assert m.frames_in == 3 and drops == {"stale": 1}, (m.frames_in, drops)
        assert sorted(r["source"] for r in served.results()) == sorted([name[a], name[b]])
        return served.streams()[name[a]], served.source.streams_health()  # type: ignore[attr-defined]
    finally:
        a.close()
        b.close()
        served.close()


def test_a_window_dropped_for_another_senders_leaves_no_backlog_once_its_stream_is_idle(tiny_sensor_bundle: Path) -> None:
    st, h = _a_window_of_a_dropped_for_bs(tiny_sensor_bundle)
    assert (st["backlog_samples"], st["oldest_unserved_age_s"]) == (0, 0.0), (
        f"sender A idle, its 2 windows published (1) or dropped (1), the pipeline idle: A's stream says "
        f"backlog_samples {st['backlog_samples']}, oldest_unserved_age_s {st['oldest_unserved_age_s']}, "
        f"source behind_s {h['behind_s']}")


def test_a_window_dropped_to_keep_up_is_counted_in_its_streams_health(tiny_sensor_bundle: Path) -> None:
    st, _ = _a_window_of_a_dropped_for_bs(tiny_sensor_bundle)
    counted = {k: v for k, v in st.items() if any(w in k for w in ("lost", "dropped", "stale", "skipped"))}
    assert any(isinstance(v, (int, float)) and v > 0 for v in counted.values()), (
        f"sender A sent 2 windows: 1 served, 1 dropped to keep up; A's stream counts {counted}")


def test_windows_dropped_by_the_multiplexer_leave_no_backlog_once_their_stream_is_idle(tiny_sensor_bundle: Path) -> None:
    """The same with `sources:` (agent/serving/multisource.py, as agent/service/served.py opens it): the source's
    own latest-frame-wins (`_offer`) and the take's `freshest` drop B's two windows for A's newer ones."""
    from agent.bundle.load import load_bundle
    from agent.config import SourceConfig
    from agent.serving.multisource import MultiSource
    from agent.serving.pipeline import Pipeline
    from agent.serving.sources import open_source
    from agent.testing import ListSink
    from agent.config import PipelineConfig

    gate = Gate()
    cfg = SourceConfig(type="udp", host="127.0.0.1", port=0)
    src = open_source(cfg, load_bundle(tiny_sensor_bundle).manifest.frame)
    many = MultiSource([(cfg, src)], capacity=2)
    (feed,) = many.feeds
    assert not feed.lossless
    sink = ListSink()
    pipeline = Pipeline(many, Gated.make_engine(tiny_sensor_bundle, gate), sink,
                        PipelineConfig(preprocess_workers=1, max_batch=1), True)
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    rng = np.random.default_rng(8)
    win = lambda: rng.normal(0, 1, (64, 3)).astype("<f4").tobytes()  # noqa: E731
    m = pipeline.metrics
    try:
        pipeline.start()
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
        to = ("127.0.0.1", src.port)  # type: ignore[attr-defined]
        name = {s: f"{src.name}/127.0.0.1:{s.getsockname()[1]}" for s in (a, b)}
        streams = lambda: src.streams_health()["streams"]  # type: ignore[attr-defined]  # noqa: E731
        a.sendto(win(), to)  # A1: taken, held at the gate
        assert gate.reached.wait(30)
        for k, s in enumerate((a, b, a), start=2):  # A2, B1 into the pipeline's queue; A3 read, waiting to go in
            s.sendto(win(), to)
            assert wait_until(lambda: m.frames_in == k, 30), (k, m.frames_in)
        b.sendto(win(), to)  # B2 waits in the multiplexer
        assert wait_until(lambda: len(feed.waiting) == 1, 30)
        a.sendto(win(), to)  # A4 replaces it there: B2 dropped
        assert wait_until(lambda: feed.stale == 1, 30)
        gate.open.set()  # A2 is swapped for A4 at the take; B1 and A3, older than A4, are skipped
        assert wait_until(lambda: feed.stale == 4 and len(sink.results) == 2 and name[a] in streams()
                          and streams()[name[a]]["backlog_samples"] == 0, 30), (feed.stale, len(sink.results), streams())
        st = streams()[name[b]]
        assert (st["backlog_samples"], st["oldest_unserved_age_s"]) == (0, 0.0), (
            f"sender B idle, its 2 windows dropped, the pipeline idle: B's stream says backlog_samples "
            f"{st['backlog_samples']}, oldest_unserved_age_s {st['oldest_unserved_age_s']}")
    finally:
        gate.open.set()
        a.close()
        b.close()
        pipeline.stop()
        pipeline.join(timeout=15)
        pipeline.close_source()
        many.close()
