"""Review of issue 44 (44r): a stateful bundle swapped in (an update, a reload) over a sensor source opened for a
stateless one is served by the old bundle's stream rules.

Issue 44 (1)/(3): a gap is a hole in stream time and resets the state; one contract for every sensor source,
and a source that cannot keep it is refused by `config check` and at boot. An update changes the bundle, not
the config, and the running pipeline takes the new engine (agent/service/served.py `serve_engine`:
`pipeline.swap_engine`; `retarget_decode` retargets only a video source's decode). The sensor source keeps the
frame it was opened with: the old bundle's, whose state inputs declared no `reset_on_gap_s`, and its UDP
hand-over stays latest-frame-wins (`source.live`: a stateless bundle's). The stateful bundle then never sees a
gap: a sender silent for 1 s (reset_on_gap_s 0.2) is served with the state carried across the silence, where
a boot with the same bundle and config resets it and says so."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.errors import SwapRefused
from gated_pipeline import Gate, Gated
from tests.serving.test_sensor_backlog import C, SR, W, _stream, bundle  # noqa: F401 (bundle: the fixture)
from waiting import wait_until


@pytest.fixture(scope="module")
def stateless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stateless bundle taking the same frame as the suite's stateful one (its version 1, say)."""
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_sensor_model

    d = tmp_path_factory.mktemp("stateless-stream")
    spec = {"name": "stateful-stream", "version": 1, "label": "0.1.0", "task": "raw",
            "frame": {"kind": "sensor", "window": W, "channels": C, "dtype": "float32", "sample_rate": SR},
            "preprocess": {"layout": "ncw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": 3}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    np.savez(d / "golden.npz", raw=np.stack([_stream(s, 1) for s in range(8)]))
    return create_bundle(CreateOptions(model=make_tiny_sensor_model(d / "m.onnx", window=W, channels=C),
                                       spec=d / "spec.yaml", calibration=d / "golden.npz", golden=d / "golden.npz",
                                       out=d / "bundle", int8=False))


def _serve(served: Gated, tx: socket.socket, x: np.ndarray, k: int) -> dict:
    """Window k of x, sent alone; its result once published (nothing waits behind it: nothing dropped)."""
    n = len(served.results())
    tx.sendto(x[k * W:(k + 1) * W].astype("<f4").tobytes(), ("127.0.0.1", served.source.port))
    assert wait_until(lambda: len(served.results()) > n, 30), k
    return served.results()[-1]["result"]["stream"]


def test_a_stateful_bundle_swapped_in_resets_at_a_gap_as_at_boot(stateless: Path, bundle: Path) -> None:  # noqa: F811
    gate = Gate()
    gate.open.set()
    served = Gated(stateless, gate, type="udp", host="127.0.0.1", port=0).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    x = _stream(44, 8)
    try:
        _serve(served, tx, x, 0)  # the stateless bundle serves
        with pytest.raises(SwapRefused, match="sensor frame differs"):  # an update to the stateful bundle
            served.pipeline.swap_engine(Gated.make_engine(bundle, None))
        # what the agent does on the refusal (agent/service/served.py serve_engine): a pipeline and a source
        # opened for the new bundle, as at boot
        served.close()
        served = Gated(bundle, gate, type="udp", host="127.0.0.1", port=0).start()
        before = [_serve(served, tx, x, k) for k in (1, 2, 3)]
        time.sleep(1.0)  # the stimulus: the sender is silent for 1 s, five times reset_on_gap_s
        after = _serve(served, tx, x, 4)
        assert [s["state"] for s in before][1:] == ["carried", "carried"]
        assert after["state"].startswith("reset"), (
            f"after 1 s of silence (reset_on_gap_s 0.2) the stateful bundle's window says {after['state']!r} "
            f"(session {after['session']}, window {after['window']})")
    finally:
        tx.close()
        served.close()
