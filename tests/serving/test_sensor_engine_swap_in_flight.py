"""Review of issue 44 (44r): an engine swap (an update, a reload) with windows of a stateful stream in flight.

docs/sensors.md: "What a stream loses is a hole: the state starts again after it and the first window after it
says how much was lost (`result.stream.state`)". The pipeline binds each window to the engine serving when it
is taken (agent/serving/pipeline.py `swap_engine`: "Frames preprocessed for the old engine finish on it; the
next frame uses the new one"). The new engine has no state for the stream, and its first window of it says
`initial (1 windows of the stream not served)`: a loss that never happened -- window 0 was served, by the old
engine, and its result published. The state does start again there; the result should say why (the engine
changed), never count served windows as not served."""

from __future__ import annotations

import socket
from pathlib import Path


from gated_pipeline import Gate, Gated
from tests.serving.test_sensor_backlog import W, _stream, bundle  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


def test_an_engine_swap_with_windows_in_flight_claims_no_loss(bundle: Path) -> None:  # noqa: F811
    gate = Gate()
    served = Gated(bundle, gate, type="udp", host="127.0.0.1", port=0)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    x = _stream(43, 3)
    try:
        served.start()
        tx.sendto(x.astype("<f4").tobytes(), ("127.0.0.1", served.source.port))  # 3 windows in one datagram
        assert gate.reached.wait(30)  # window 0 runs on the first engine, held; windows 1 and 2 wait their turn
        assert wait_until(lambda: served.pipeline.metrics.frames_in == 3, 30)
        served.pipeline.swap_engine(Gated.make_engine(bundle, None))  # an update or a reload: the same bundle
        gate.open.set()
        assert wait_until(lambda: len(served.results()) == 3, 30), served.results()
        spans = [r["result"]["stream"] for r in served.results()]
        assert [(s["session"], s["window"]) for s in spans] == [(1, 0), (1, 1), (1, 2)]  # every window served
        assert served.pipeline.drops == {}
        notes = [s["state"] for s in spans]
        assert not any("not served" in n for n in notes), (
            f"all 3 windows served, none dropped; the states say {notes}")
    finally:
        tx.close()
        served.close()
