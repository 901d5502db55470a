"""Review of issue 44: every loss counted in /metrics, also after the stream it happened in has ended.

/metrics exports lost samples per stream only (`edge_agent_sensor_lost_samples{source,stream}`), from
health's list of live streams. A UDP sender quiet for `source.stream_timeout_s` leaves that list, and its
series leaves /metrics with it: the samples it lost are no longer counted anywhere /metrics shows (the
source's own `lost_samples` in health is not exported), so a counter falls back and a scrape that came
after the stream ended never sees the loss.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.vocabulary.manifest import ExtraInput, frame_from_dict
from waiting import wait_until


def _lost_in_metrics(name: str, streams: dict[str, Any]) -> float:
    from agent.link.prometheus import _stream_families

    total = 0.0
    for fam in _stream_families({"source": {"name": name, "streams": streams}}):
        if fam.name.endswith("sensor_lost_samples"):
            total += sum(s.value for s in fam.samples if s.labels.get("source") == name)
    return total


def test_samples_a_udp_stream_lost_stay_counted_in_metrics_after_the_stream_timed_out() -> None:
    from agent.serving.sensors import SensorSource

    frame = frame_from_dict({"kind": "sensor", "channels": 1, "sample_rate": 16000, "window": 256},
                            (ExtraInput("h", "state", "float32", (1, 4), from_output="hn"),))
    src = SensorSource(SourceConfig(type="udp", host="127.0.0.1", port=0, framing="seq32", stream_timeout_s=0.5),
                       frame)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stop = threading.Event()
    frames: list[Any] = []

    def read() -> None:
        while (f := src.read(stop)) is not None:
            f.settled()  # served, as the pipeline's publish stage says
            frames.append(f)

    threading.Thread(target=read, daemon=True).start()
    try:
        for n in (0, 1, 2, 5, 6):  # 3 and 4 lost: 512 samples
            tx.sendto(struct.pack("<I", n) + np.zeros(256, "<f4").tobytes(), ("127.0.0.1", src.port))
        assert wait_until(lambda: len(frames) >= 5, 10), len(frames)
        assert _lost_in_metrics(src.name, src.streams_health()) == 512  # while the stream is live: counted
        # a barrier: the sender, quiet for stream_timeout_s, has left the live streams
        assert wait_until(lambda: not src.streams_health()["streams"], 10)
        assert src.streams_health()["lost_samples"] == 512  # health still has it, at the source's level
        assert _lost_in_metrics(src.name, src.streams_health()) == 512, "the 512 lost samples left /metrics"
    finally:
        stop.set()
        tx.close()
        src.close()
