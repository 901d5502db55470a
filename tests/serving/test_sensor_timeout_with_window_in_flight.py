"""Review of issue 44 (44r): a UDP stream whose windows are still in the pipeline times out and leaves health.

docs/sensors.md: a stream frees its place "until a stream is quiet for `source.stream_timeout_s` (... a stream
with windows still to serve is behind, never quiet)", and since 0125692 backlog_samples counts "those the
pipeline has taken and still works on, in its queues or in flight ... a window leaves the backlog when its
result is published or it is dropped". `_timed_out` only asks whether the stream's own buffer holds a window
(`Stream.ready`), not whether the pipeline still holds some of its windows: a sender whose last window is in
flight (a slow or stuck inference) is timed out, its stream leaves health with that window unserved, and the
source says it is 0 s behind (behind_s) while the window waits."""

from __future__ import annotations

import socket
import time
from pathlib import Path


from gated_pipeline import Gate, Gated
from tests.serving.test_sensor_backlog import W, _stream, bundle  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


def test_a_stream_with_a_window_in_flight_is_behind_not_quiet(bundle: Path) -> None:  # noqa: F811
    gate = Gate()
    served = Gated(bundle, gate, type="udp", host="127.0.0.1", port=0, stream_timeout_s=0.5)
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    x = _stream(41, 2)
    try:
        served.start()
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
        to = ("127.0.0.1", served.source.port)
        name = {s: f"{served.source.name}/127.0.0.1:{s.getsockname()[1]}" for s in (a, b)}
        a.sendto(x[:W].astype("<f4").tobytes(), to)  # A's one window: taken, its run held at the gate
        assert gate.reached.wait(30)
        assert served.streams()[name[a]]["backlog_samples"] == W  # in flight: the agent's backlog
        time.sleep(1.0)  # the stimulus: A says nothing for twice stream_timeout_s while its window is in flight
        b.sendto(x[W:].astype("<f4").tobytes(), to)  # a new sender: the source looks for quiet streams first
        assert wait_until(lambda: name[b] in served.streams(), 30), served.streams()
        streams = served.streams()
        h = served.source.streams_health()  # type: ignore[attr-defined]
        assert name[a] in streams and streams[name[a]]["backlog_samples"] == W, (
            f"A's window still held by the pipeline (not published: {len(served.results())} results); health lists "
            f"{sorted(streams)}, behind_s {h['behind_s']}")
    finally:
        a.close()
        b.close()
        served.close()
