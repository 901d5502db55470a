"""Review of issue 44 (44r): a backlog shed while a window of the stream is in flight leaves that window in
backlog_samples but says the agent is 0 s behind.

docs/sensors.md: backlog_samples counts "those the pipeline has taken and still works on, in its queues or in
flight", `oldest_unserved_age_s` is "how long ago the oldest of them arrived", and "Both are 0 while no window
of the stream waits or is being served". `Stream.shed` forgets every arrival (`arrivals.clear()`), those of
the windows the pipeline still holds too, so while such a window is in flight the stream reports a backlog
with no age: `oldest_unserved_age_s` and the source's `behind_s` stay 0 however long the window waits."""

from __future__ import annotations

import socket
import time
from pathlib import Path


from gated_pipeline import Gate, Gated
from tests.serving.test_sensor_backlog import W, _stream, bundle  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


def test_a_window_in_flight_across_a_shed_keeps_its_age(bundle: Path) -> None:  # noqa: F811
    gate = Gate()
    # 0.1 s at 32 kHz: 3,200 samples, 12.5 windows of the stream; a datagram of 16 windows is beyond it
    served = Gated(bundle, gate, type="udp", host="127.0.0.1", port=0, max_backlog_s=0.1)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    x = _stream(42, 17)
    try:
        served.start()
        to = ("127.0.0.1", served.source.port)
        sent = time.time()
        tx.sendto(x[:W].astype("<f4").tobytes(), to)  # one window: taken, its run held at the gate
        assert gate.reached.wait(30)
        tx.sendto(x[W:].astype("<f4").tobytes(), to)  # 16 more windows at once: beyond max_backlog_s, shed
        h = served.source.streams_health  # type: ignore[attr-defined]
        assert wait_until(lambda: h()["lost_samples"] == 16 * W, 30), h()
        time.sleep(1.0)  # the stimulus: the window in flight waits a second more
        (st,) = h()["streams"].values()
        assert st["backlog_samples"] == W and not served.results()  # the window in flight: still the backlog
        assert st["oldest_unserved_age_s"] >= 1.0 and h()["behind_s"] >= 1.0, (
            f"a window delivered {time.time() - sent:.2f} s ago and still in flight (backlog_samples "
            f"{st['backlog_samples']}): oldest_unserved_age_s {st['oldest_unserved_age_s']}, behind_s {h()['behind_s']}")
    finally:
        tx.close()
        served.close()
