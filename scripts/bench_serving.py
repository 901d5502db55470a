"""Serving benchmark on camera-sized inputs: one run, one table, every column measured side by side.

Inputs: 720p and 1080p MJPEG videos (camera-like: the held-out pictures scaled up, with sensor noise), and
the same as H.264 (Debian's ffmpeg, libx264 veryfast, no B-frames, as cameras send); with --rtsp the H.264
inputs also as RTSP streams from tests/fixtures/rtsp_server.py on 127.0.0.1 (as fast as the reader takes
them). Per row:

  dec full      `cv2.VideoCapture.read` alone (FFmpeg, full size, BGR)
  dec agent     the agent's own source with its decoding and conversion at the scale shown, one thread
                (JPEG at reduced scale; H.264 planes reduced before the colour conversion)
  naive         the loop a user writes: cv2 read -> RGB -> the bundle's preprocessing -> run -> decode -> json
  agent         `edge-agent run` as a separate process (files lossless, streams stopped after --frames
                results), fps from the first to the last result
  ag/naive, ag/lim   agent / naive; agent / the pipeline limit = min(capture stage alone, cores / seq)
  CPU ms/f      process CPU per frame (FFmpeg's threads counted): the agent's (from /proc between its first
                and last result) : the naive loop's; ag/nv their ratio
  seq, ag/seq   the agent's stages (its source's decode, preprocessing, one-thread inference, postprocessing
                and JSON) run one after the other in this process, CPU ms per frame; the agent's CPU against it
  RSS MB        the agent's peak RSS (VmHWM: the boot proof included)
  load          the 1-minute load average at the row's start and end

The agent runs with its shipped defaults; each setting the benchmark changes is printed above the table,
and the issue's targets are printed beside what was measured.

Usage: python scripts/bench_serving.py [--bundle DIR | --detector] [--inputs 720p-mjpeg,1080p-mjpeg,720p-h264,1080p-h264]
                                       [--rtsp] [--frames 300] [--runs 3] [--variant auto|fp32|int8] [--intra N] [--spin]
       python scripts/bench_serving.py --sources 4 [--camera-input 1080p-h264 --rtsp] [--camera-fps 10] [--frames 100]
           (the many-sources row: N cameras through one agent, against one camera: fps per source, p95 capture
           to publish, peak and serving RSS, agent CPU per result)
       python scripts/bench_serving.py --live-view [--camera-input 720p-mjpeg] [--camera-fps 30] [--frames 450] [--runs 3]
           (the live view's cost: the same video served with the live view off, on with nobody watching, and on
           with one viewer on its MJPEG stream, interleaved in one run, the file paced at --camera-fps: fps and CPU
           per result against off)
       python scripts/bench_serving.py --cold [--runs 3] [--no-bytecode]   (first result after start, cold and with
           the cached verdict, the process's CPU seconds by then and the proof's own, for the demo and the
           detector; agent/ byte-compiled first, as an installed agent is, unless --no-bytecode)

--detector and the many-sources row serve the YOLO-class detector when the real-model cache holds the layout
model (scripts/real_models.py fetch layout): the YOLOv8n DocLayNet model re-sized to a 320x320 input and
bundled by scripts/yolo_resize.py (FP32; a throughput model, not an accuracy claim), on camera videos of the
suite's synthetic document pages. Without it the many-sources row serves the demo classifier.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
LAYOUT = CACHE / "real-models" / "layout"
DEMO_BUNDLE = ROOT / "models" / "digits-classifier"

from agent.bundle.load import load_bundle
from agent.config import Config, SourceConfig
from agent.proof.selftest import options_from_config, run_selftest
from agent.proof.session import open_session
from agent.proof.terms import SessionSettings
from agent.serving.decoding import max_decode_scale
from agent.serving.sources import open_source
from agent.vocabulary.decoders import decode

INPUTS = {"720p-mjpeg": (720, 1280, "mjpeg"), "1080p-mjpeg": (1080, 1920, "mjpeg"),
          "720p-h264": (720, 1280, "h264"), "1080p-h264": (1080, 1920, "h264")}
CORES = len(os.sched_getaffinity(0))
TICK = os.sysconf("SC_CLK_TCK")


def _variant_and_frames(bundle: Any, variant: str, tmp: Path, frames_from: Path) -> tuple[str, np.ndarray]:
    """The variant a run serves (`auto`: the self-test's pick on this machine) and the frames its videos are made of."""
    if variant == "auto":
        variant = run_selftest(bundle, tmp / "state", options_from_config(Config())).selected.candidate.variant
    with np.load(frames_from) as z:
        return variant, z["raw"]


def camera_video(raw: np.ndarray, h: int, w: int, n: int, codec: str, tmp: Path) -> Path:
    """n camera-like frames (a digit picture scaled to h x w, sensor noise sigma 2) as MJPEG (OpenCV's
    writer, its default quality) or H.264 (ffmpeg libx264 veryfast, no B-frames, as cameras send)."""
    mjpeg = tmp / f"cam-{h}p.avi"
    if not mjpeg.exists():
        rng = np.random.default_rng(0)
        writer = cv2.VideoWriter(str(mjpeg), cv2.VideoWriter_fourcc(*"MJPG"), 30, (w, h))
        if not writer.isOpened():
            raise SystemExit(f"cannot write {mjpeg}")
        for i in range(n):
            big = cv2.resize(cv2.cvtColor(raw[i % len(raw)], cv2.COLOR_RGB2BGR), (w, h), interpolation=cv2.INTER_LINEAR)
            noise = rng.normal(0, 2, big.shape).astype(np.int16)
            writer.write(np.clip(big.astype(np.int16) + noise, 0, 255).astype(np.uint8))
        writer.release()
    if codec == "mjpeg":
        return mjpeg
    out = tmp / f"cam-{h}p.mp4"
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-i", str(mjpeg), "-c:v", "libx264",
                    "-preset", "veryfast", "-tune", "zerolatency", "-pix_fmt", "yuv420p", "-y", str(out)], check=True)
    return out


def raw_best(model: Path, tensor: np.ndarray, n: int) -> float:
    """Best of 1 caller x CORES intra-op threads and CORES callers x 1 thread, on one tensor."""
    many = open_session(model, "CPUExecutionProvider", settings=SessionSettings(intra_op_threads=CORES))
    one = open_session(model, "CPUExecutionProvider", settings=SessionSettings(intra_op_threads=1))
    for s in (many, one):
        for _ in range(20):
            s.run(tensor)
    t0 = time.perf_counter()
    for _ in range(n):
        many.run(tensor)
    single = n / (time.perf_counter() - t0)

    def loop() -> None:
        for _ in range(n // CORES):
            one.run(tensor)

    threads = [threading.Thread(target=loop) for _ in range(CORES)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parallel = (n // CORES) * CORES / (time.perf_counter() - t0)
    return max(single, parallel)


def decode_full(video: Path | str, n: int = 0) -> float:
    cap = cv2.VideoCapture(str(video), cv2.CAP_FFMPEG)
    count, t0 = 0, time.perf_counter()
    while (not n or count < n) and cap.read()[0]:
        count += 1
    cap.release()
    return count / (time.perf_counter() - t0)


def agent_source(video: Path | str, bundle, scale: int):
    cfg = (SourceConfig(type="stream", url=video, decode_scale=scale) if isinstance(video, str)
           else SourceConfig(type="video", path=video, decode_scale=scale))
    return open_source(cfg, bundle.manifest.frame, bundle.manifest.preprocess.resize)


def decode_agent(video: Path | str, bundle, scale: int, decode: bool = True, n: int = 0) -> float:
    """The agent's source alone, one thread: with `decode`, each frame's deferred decoding and colour
    conversion too (what the preprocessing pool does first); without, the capture stage alone."""
    src = agent_source(video, bundle, scale)
    stop = threading.Event()
    count, t0 = 0, time.perf_counter()
    while (not n or count < n) and (f := src.read(stop)) is not None:
        if decode:
            _ = f.data  # the decode the preprocessing pool does first
        count += 1
    src.close()
    return count / (time.perf_counter() - t0)


def naive(video: Path | str, bundle, sess, n: int = 0, warm: int = 0) -> tuple[float, float, float]:
    """The ten-line loop a user writes: (fps, process CPU ms per frame, the same from frame `warm` on), FFmpeg's
    decoder threads counted."""
    pre, spec, labels = bundle.preprocessor(), bundle.manifest.postprocess, bundle.labels()
    sink = io.StringIO()
    cap = cv2.VideoCapture(str(video), cv2.CAP_FFMPEG)
    count, t0, c0 = 0, time.perf_counter(), time.process_time()
    cw = c0
    while not n or count < n:
        if count == warm:
            cw = time.process_time()
        ok, img = cap.read()
        if not ok:
            break
        rgb = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        out = sess.run(pre(rgb))
        result = decode(spec, {k: v[0] for k, v in out.items()}, labels, pre.geometry(rgb))
        sink.write(json.dumps({"seq": count, "result": result}) + "\n")
        count += 1
    cap.release()
    c1 = time.process_time()
    return count / (time.perf_counter() - t0), (c1 - c0) / max(count, 1) * 1000, (c1 - cw) / max(count - warm, 1) * 1000


def cpu_per_frame(video: Path | str, bundle, sess1, scale: int, n: int = 0,
                  warm: int = 0) -> tuple[dict[str, float], float]:
    """Process CPU ms per frame of each stage, run one after the other in this thread with a 1-thread session
    (FFmpeg's own decoder threads are counted: process time, not thread time); and their total from frame
    `warm` on."""
    pre, spec, labels = bundle.preprocessor(), bundle.manifest.postprocess, bundle.labels()
    src = agent_source(video, bundle, scale)
    stop = threading.Event()
    acc = {"decode": 0.0, "preprocess": 0.0, "inference": 0.0, "postprocess": 0.0}
    count, steady = 0, 0.0
    while not n or count < n:
        t0 = time.process_time()
        f = src.read(stop)
        if f is None:
            break
        data = f.data  # the colour conversion owed (FFmpeg frames) is decoding work done elsewhere
        t1 = time.process_time()
        tensor = pre(data)
        t2 = time.process_time()
        out = sess1.run(tensor)
        t3 = time.process_time()
        json.dumps(decode(spec, {k: v[0] for k, v in out.items()}, labels, pre.geometry(data)))
        t4 = time.process_time()
        for k, a, b in (("decode", t0, t1), ("preprocess", t1, t2), ("inference", t2, t3), ("postprocess", t3, t4)):
            acc[k] += b - a
        if count >= warm:
            steady += t4 - t0
        count += 1
    src.close()
    return {k: v / count * 1000 for k, v in acc.items()}, steady / max(count - warm, 1) * 1000


def _proc_cpu_s(pid: int, children: bool = False) -> float:
    """utime + stime (and, with `children`, those of its ended children: a boot proof run in a child process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)) / TICK


def _proc_hwm_mb(pid: int, key: str = "VmHWM") -> float:
    """Peak RSS (VmHWM: the boot proof included), or with key="VmRSS" the RSS now (serving)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class AgentRun:
    fps: float
    results: int
    cpu_ms: float
    rss_mb: float
    steady_cpu_ms: float  # from result `warm` on: the stages sized, the decoder planned


def agent(video: Path | str, bundle_dir: Path, variant: str, settings: dict, n: int, tmp: Path,
          warm: int = 0) -> AgentRun:
    """`edge-agent run` as its own process on a file (lossless, to its end) or a stream URL (stopped after n
    results): fps from the first to the last result, its CPU per result (and from result `warm` on) and peak RSS
    from /proc."""
    source = ({"type": "stream", "url": video} if isinstance(video, str) else {"type": "video", "path": str(video)})
    cfg = {"state_dir": str(tmp / "state"), "bundle": str(bundle_dir), "source": source}
    for key, value in settings.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    (tmp / "agent.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config",
                             str(tmp / "agent.yaml")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    first = last = None
    count, cpu0, cpu1, rss, last_counted = 0, 0.0, 0.0, float("nan"), 1
    cpu_w = 0.0
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.perf_counter()
        count += 1
        if count == 1:
            first, cpu0 = now, _proc_cpu_s(proc.pid)
        if count == max(warm, 1):
            cpu_w = cpu0 if count == 1 else _proc_cpu_s(proc.pid)
        last = now
        if count == n or count % 50 == 0:  # /proc on every line would take CPU from the agent
            try:
                cpu1, rss, last_counted = _proc_cpu_s(proc.pid), _proc_hwm_mb(proc.pid), count
            except FileNotFoundError:
                pass
        if count == n and isinstance(video, str):
            proc.terminate()  # a stream never ends
            break
    proc.wait()
    if count < 2 or first is None or last is None:
        raise SystemExit(f"the agent published {count} results (exit {proc.returncode})")
    return AgentRun((count - 1) / (last - first), count, (cpu1 - cpu0) / max(last_counted - 1, 1) * 1000, rss,
                    (cpu1 - cpu_w) / max(last_counted - max(warm, 1), 1) * 1000)


SERVING_AFTER = 30  # results: the cold-start row's serving RSS is read at this one


def first_result(video: Path, bundle_dir: Path, state: Path) -> tuple[float, float, float, float]:
    """`edge-agent run` from spawn to its first result: (seconds, the process's CPU seconds by then, peak RSS MB
    by then, RSS MB while serving: at result SERVING_AFTER or the video's end). A fresh `state` proves the bundle
    cold; the same one again serves from the cached verdict."""
    cfg = {"state_dir": str(state), "bundle": str(bundle_dir), "source": {"type": "video", "path": str(video)}}
    path = state.parent / f"{state.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    took = time.perf_counter() - t0
    cpu, rss = _proc_cpu_s(proc.pid, children=True), _proc_hwm_mb(proc.pid)
    serving = float("nan")
    for _ in range(SERVING_AFTER - 1):
        if not proc.stdout.readline():
            break
        serving = _proc_hwm_mb(proc.pid, "VmRSS")
    proc.terminate()
    proc.wait(timeout=30)
    if not line:
        raise SystemExit(f"the agent published no result (exit {proc.returncode})")
    return took, cpu, rss, serving


def report_child_peak_mb(state: Path) -> float:
    """The proof's peak RSS as its report says (each part's `peak_rss_mb`: the proof child's own, at boot)."""
    try:
        costs = json.loads((state / "selftest" / "report.json").read_text()).get("costs", [])
        return max((float(c["peak_rss_mb"]) for c in costs if "peak_rss_mb" in c), default=float("nan"))
    except (OSError, ValueError):
        return float("nan")


def agent_bytecode(compiled: bool) -> str:
    """An installed agent runs from byte-compiled modules (pip compiles them at install); a checkout under
    PYTHONDONTWRITEBYTECODE=1 (as CI and this machine set it) compiles every agent module from source in each
    process, the agent's and the proof child's. Compiled: `compileall` the checkout's agent/ once, as pip
    would; otherwise its __pycache__ folders are removed. Returns the setting, as printed."""
    if compiled:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "agent")], check=True)
        return "agent/ byte-compiled (python -m compileall agent, as pip install does)"
    for cache in (ROOT / "agent").rglob("__pycache__"):
        shutil.rmtree(cache)
    return "agent/ not byte-compiled (--no-bytecode: every module compiled from source in each process)"


def report_cpu_s(state: Path) -> float:
    """The proof's own CPU seconds as its report counts them (the sum of its parts' `costs`)."""
    try:
        return float(json.loads((state / "selftest" / "report.json").read_text()).get("cpu_ms", float("nan"))) / 1000
    except (OSError, ValueError):
        return float("nan")


def cold_start(args: argparse.Namespace) -> int:
    """First result after start, cold (the boot proof runs) and with the cached verdict, per bundle."""
    bundles = [("demo", DEMO_BUNDLE, ROOT / "calibration" / "digits" / "heldout.npz")]
    if (LAYOUT / "model.onnx").exists() and (LAYOUT / "heldout.npz").exists():
        bundles.append(("detector", *yolo_bundle()))
    else:
        print(f"note: no detector row: the layout model's references are not built ({LAYOUT}/heldout.npz)")
    print(f"setting: {agent_bytecode(not args.no_bytecode)}")
    print(f"{'bundle':9} {'run':6} {'first result s':>14} {'CPU s by then':>13} {'proof CPU s':>11} "
          f"{'peak RSS MB':>11} {'serving RSS':>11} {'proof child peak':>16} {'child/serving':>13} {'load':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, bundle_dir, frames_from in bundles:
            (tmp / name).mkdir()
            with np.load(frames_from) as z:
                video = camera_video(z["raw"], 720, 1280, 30, "h264", tmp / name)
            for r in range(args.runs):
                state = tmp / f"{name}-state-{r}"
                for run in ("cold", "cached"):
                    took, cpu, rss, serving = first_result(video, bundle_dir, state)
                    child = report_child_peak_mb(state)
                    print(f"{name:9} {run:6} {took:>14.2f} {cpu:>13.2f} {report_cpu_s(state):>11.2f} {rss:>11.0f} "
                          f"{serving:>11.0f} {child:>16.0f} {child / serving:>13.2f} {os.getloadavg()[0]:>5.1f}",
                          flush=True)
    print("cold: a fresh state directory (the boot proof runs); cached: the same again (the cached verdict); "
          "CPU s = the agent process's user+system time at its first result, with its ended children's (the proof, "
          "imports, the first frame); proof CPU s = the report's `cpu_ms` (its parts' costs, imports excluded); "
          f"peak RSS = the agent's VmHWM at its first result; serving RSS = its VmRSS at result {SERVING_AFTER}; "
          "proof child peak = the report's largest `peak_rss_mb` (the proof child's own ru_maxrss: on a cached "
          "row, the child that checked the cached verdict)")
    return 0


class RtspCamera:
    """tests/fixtures/rtsp_server.py serving a video (re-encoded as Annex B H.264, one slice per frame) on
    127.0.0.1 at `fps` (1000: as fast as the reader takes it)."""

    def __init__(self, video: Path, tmp: Path, fps: float):
        es = tmp / (video.stem + ".h264")
        if not es.exists():
            subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-i", str(video), "-c:v", "libx264",
                            "-preset", "veryfast", "-tune", "zerolatency", "-threads", "1", "-bf", "0",
                            "-pix_fmt", "yuv420p", "-f", "h264", "-y", str(es)], check=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"rtsp://127.0.0.1:{port}/cam"
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fixtures" / "rtsp_server.py"), str(port),
                                      str(es), "--fps", str(fps)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass
class MultiRun:
    sources: int
    fps: dict[str, float]      # results/s per source, first to last result of that source
    results: dict[str, int]
    p50_ms: float              # capture -> publish (the result's total_ms), all sources together
    p95_ms: float
    rss_mb: float
    serving_rss_mb: float      # VmRSS at the last sample, while serving (rss_mb: the peak, boot included)
    cpu_ms: float              # the agent's CPU time per result
    load: tuple[float, float]  # 1-minute load average before and after


def multi_agent(videos: list[Path | str], bundle_dir: Path, settings: dict, fps: float, tmp: Path,
                frames: int) -> MultiRun:
    """`edge-agent run` with one `sources:` entry per video, each paced at `fps` (a camera's rate), lossless;
    or per RTSP URL (a camera at its own rate, latest-wins), stopped once each has `frames` results."""
    cfg: dict = {"state_dir": str(tmp / "state"), "bundle": str(bundle_dir),
                 "sources": [{"name": f"cam{i}", "type": "stream", "url": v} if isinstance(v, str) else
                             {"name": f"cam{i}", "type": "video", "path": str(v), "max_fps": fps}
                             for i, v in enumerate(videos)]}
    live = isinstance(videos[0], str)
    for key, value in settings.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    path = tmp / f"agent-{len(videos)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    load0 = os.getloadavg()[0]
    expected = frames * len(videos)
    proc = subprocess.Popen([sys.executable, "-m", "agent", "--log-level", "warning", "run", "--config", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    totals: list[float] = []
    cpu0 = cpu1 = 0.0
    rss = now_rss = float("nan")
    n = counted = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.perf_counter()
        r = json.loads(line)
        src = r["source"]
        first.setdefault(src, now)
        last[src] = now
        count[src] = count.get(src, 0) + 1
        totals.append(r["timings"]["total_ms"])
        n += 1
        if n == 1:
            cpu0 = _proc_cpu_s(proc.pid)
        if n % 50 == 0 or n == expected:  # /proc on every line would take CPU from the agent
            try:
                cpu1, rss, counted = _proc_cpu_s(proc.pid), _proc_hwm_mb(proc.pid), n
                now_rss = _proc_hwm_mb(proc.pid, "VmRSS")
            except FileNotFoundError:
                pass
        if live and len(count) == len(videos) and min(count.values()) >= frames:
            proc.terminate()  # streams never end
            break
    proc.wait()
    if n < 2:
        raise SystemExit(f"the agent published {n} results (exit {proc.returncode})")
    return MultiRun(len(videos), {k: (count[k] - 1) / max(last[k] - first[k], 1e-9) for k in count}, count,
                    float(np.percentile(totals, 50)), float(np.percentile(totals, 95)), rss, now_rss,
                    (cpu1 - cpu0) / max(counted - 1, 1) * 1000,
                    (round(load0, 2), round(os.getloadavg()[0], 2)))


def camera_videos(raw: np.ndarray, h: int, w: int, n: int, k: int, tmp: Path, codec: str = "mjpeg") -> list[Path]:
    """k distinct camera videos (each starts at another held-out picture)."""
    out = []
    for j in range(k):
        d = tmp / f"cam{j}"
        d.mkdir(exist_ok=True)
        out.append(camera_video(np.roll(raw, -j * 17, axis=0), h, w, n, codec, d))
    return out


def spread_ms(values: list[float]) -> str:
    """As `spread`, with the decimals a CPU time per result needs."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=None,
                    help="the model bundle (default: the demo classifier; for --sources, the YOLO-320 layout bundle "
                         "when the real-model cache holds the layout model)")
    ap.add_argument("--detector", action="store_true",
                    help="the YOLO-320 layout detector from the real-model cache, on camera videos of its pages")
    ap.add_argument("--inputs", default="720p-mjpeg,1080p-mjpeg,720p-h264,1080p-h264",
                    help=f"comma-separated, of {', '.join(INPUTS)} (H.264 needs Debian's ffmpeg)")
    ap.add_argument("--rtsp", action="store_true",
                    help="H.264 inputs also as RTSP streams from tests/fixtures/rtsp_server.py (as fast as read)")
    ap.add_argument("--frames", type=int, default=300, help="frames per video")
    ap.add_argument("--runs", type=int, default=1, help="repeat each measurement; the table shows median [min-max]")
    ap.add_argument("--warm", type=int, default=None,
                    help="the steady columns leave out each loop's first this many frames (default: a tenth of "
                         "--frames, at least 60: the agent sizes its stages over its first 56 results)")
    ap.add_argument("--variant", default="auto", help="auto: the self-test's choice, then pinned for the agent")
    ap.add_argument("--intra", type=int, default=None,
                    help="intra-op threads for the naive loop and the agent (0: ORT's default; unset: the agent's default)")
    ap.add_argument("--spin", action="store_true", help="let ORT pool threads spin (ORT's default; off in the agent)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the many-sources row: an agent config key (dotted) and its YAML value, e.g. "
                         "session.memory_pattern=true; printed with the settings changed")
    ap.add_argument("--sources", type=int, default=0,
                    help="the many-sources row instead: this many cameras (--camera-input at --camera-fps each) "
                         "served by one agent, against the same agent with one of them")
    ap.add_argument("--camera-fps", type=float, default=15.0, help="each camera's frame rate in the many-sources row")
    ap.add_argument("--camera-input", default="720p-mjpeg", help="the many-sources row's camera input")
    ap.add_argument("--no-bytecode", action="store_true", help="--cold: run the agent from source, every module "
                    "compiled in each process (the checkout under PYTHONDONTWRITEBYTECODE=1), not byte-compiled")
    ap.add_argument("--live-view", action="store_true", help="the live view's cost instead: off, on with nobody "
                    "watching, on with one MJPEG viewer (--camera-input, --frames, --runs)")
    ap.add_argument("--cold", action="store_true", help="the cold-start table instead: first result after start, "
                    "cold and cached, for the demo and (when cached) the detector")
    args = ap.parse_args()
    if args.cold:
        return cold_start(args)
    if args.sources:
        return many_sources(args)
    if args.live_view:
        return live_view_cost(args)
    frames_from = ROOT / "calibration" / "digits" / "heldout.npz"
    if args.detector:
        args.bundle, frames_from = yolo_bundle()
    args.bundle = args.bundle or DEMO_BUNDLE
    inputs = [i.strip() for i in args.inputs.split(",") if i.strip()]
    unknown = [i for i in inputs if i not in INPUTS]
    if unknown:
        raise SystemExit(f"--inputs: unknown {unknown} (known: {list(INPUTS)})")
    if shutil.which("ffmpeg") is None:
        skipped = [i for i in inputs if INPUTS[i][2] == "h264"]
        inputs = [i for i in inputs if INPUTS[i][2] != "h264"]
        if skipped:
            print(f"skipping {skipped}: no ffmpeg to encode H.264 (apt-get install ffmpeg)")
    bundle = load_bundle(args.bundle)
    resize = bundle.manifest.preprocess.resize
    rows, stages = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variant = args.variant
        proof = run_selftest(bundle, tmp / "state", options_from_config(Config(), variant=None if variant == "auto"
                                                                         else variant))
        if variant == "auto":
            variant = proof.selected.candidate.variant
        proven_scale = proof.decode_max_scale  # the agent never decodes below what its self-test proved
        model = bundle.path(bundle.manifest.variant(variant).file)
        with np.load(frames_from) as z:
            raw = z["raw"]
        pre = bundle.preprocessor()
        session_changes = {**({"session.intra_op_threads": args.intra} if args.intra is not None else {}),
                           **({"session.allow_spinning": True} if args.spin else {})}
        shipped = SessionSettings()
        agent_session = SessionSettings(intra_op_threads=shipped.intra_op_threads if args.intra is None else args.intra,
                                        allow_spinning=args.spin or shipped.allow_spinning)
        sess = open_session(model, "CPUExecutionProvider", settings=agent_session)  # the naive loop: as the agent
        sess1 = open_session(model, "CPUExecutionProvider", settings=SessionSettings(intra_op_threads=1))
        best = raw_best(model, pre(raw[0]), max(args.frames, 600) if not args.detector else 60)
        cases = [(name, "file") for name in inputs]
        if args.rtsp:
            cases += [(name, "rtsp") for name in inputs if INPUTS[name][2] == "h264"]
        for name, transport in cases:
            h, w, codec = INPUTS[name]
            video: Path | str = camera_video(raw, h, w, args.frames, codec, tmp)
            camera = RtspCamera(video, tmp, 1000.0) if transport == "rtsp" else None
            if camera is not None:
                video = camera.url
            n = args.frames if camera is not None else 0  # a stream never ends: this many frames
            # the daemon decodes at the scale the bundle's resize allows and the self-test proved (auto)
            scale = min(max_decode_scale(resize, h, w), proven_scale)
            settings = {"selection.variant": variant, **session_changes}
            full, dec, cap, nai, nai_cpu, lim, runs, cpu, load = [], [], [], [], [], [], [], [], []
            nai_steady, seq_steady = [], []
            warm = args.warm if args.warm is not None else max(60, args.frames // 10)
            try:
                for _ in range(args.runs):
                    load.append(os.getloadavg()[0])
                    full.append(decode_full(video, n))
                    dec.append(decode_agent(video, bundle, scale, n=n))
                    cap.append(decode_agent(video, bundle, scale, decode=False, n=n))
                    fps, cpu_ms, cpu_steady = naive(video, bundle, sess, n, warm)
                    nai.append(fps)
                    nai_cpu.append(cpu_ms)
                    nai_steady.append(cpu_steady)
                    stage_ms, steady_ms = cpu_per_frame(video, bundle, sess1, scale, n, warm)
                    cpu.append(stage_ms)
                    seq_steady.append(steady_ms)
                    total = sum(cpu[-1].values())
                    lim.append(min(cap[-1], CORES / (total / 1000)))
                    runs.append(agent(video, args.bundle, variant, settings, args.frames, tmp, warm))
                    load.append(os.getloadavg()[0])
            finally:
                if camera is not None:
                    camera.close()
            fps_a = [r.fps for r in runs]
            seq = [sum(c.values()) for c in cpu]
            rows.append({
                "name": name, "transport": transport, "scale": scale, "best": best, "full": full, "dec": dec,
                "cap": cap, "naive": nai, "limit": lim, "agent": fps_a,
                "ag_lim": statistics.median(a / b for a, b in zip(fps_a, lim)),
                "ag_naive": statistics.median(a / b for a, b in zip(fps_a, nai)),
                "cpu": statistics.median(r.cpu_ms for r in runs), "naive_cpu": statistics.median(nai_cpu),
                "cpu_naive": statistics.median(r.cpu_ms / c for r, c in zip(runs, nai_cpu)),
                "seq": statistics.median(seq), "cpu_seq": statistics.median(r.cpu_ms / c for r, c in zip(runs, seq)),
                "rss": max(r.rss_mb for r in runs), "results": min(r.results for r in runs), "settings": settings,
                "warm": warm, "st_naive": statistics.median(r.steady_cpu_ms / c for r, c in zip(runs, nai_steady)),
                "st_seq": statistics.median(r.steady_cpu_ms / c for r, c in zip(runs, seq_steady)),
                "st_cpu": statistics.median(r.steady_cpu_ms for r in runs), "st_seq_ms": statistics.median(seq_steady),
                "load": (min(load), max(load)),
            })
            stages.append((f"{name} {transport}", {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}))

    print(f"\nmodel {bundle.manifest.name} (variant {variant}, input {resize.width if resize else '-'}x"
          f"{resize.height if resize else '-'}), {args.frames} frames per video (frames from {frames_from.name}), "
          f"{CORES} cores, onnxruntime CPU, runs {args.runs}; session.run alone on one tensor (best of 1 x {CORES} "
          f"threads, {CORES} x 1): {best:.0f}/s")
    print("agent settings changed from the shipped defaults: --log-level warning; " +
          ", ".join(f"{k}={v}" for k, v in rows[0]["settings"].items()) if rows else "")
    print(f"{'input':11} {'via':4} {'scale':>5} {'dec full':>12} {'dec agent':>12} {'naive':>12} {'agent':>12} "
          f"{'ag/naive':>8} {'ag/lim':>6} {'CPU ms/f agent : naive':>22} {'ag/nv':>5} {'seq':>5} {'ag/seq':>6} "
          f"{'RSS MB':>6} {'load':>9}")
    for r in rows:
        cpus = f"{r['cpu']:.2f} : {r['naive_cpu']:.2f}"
        load = f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        print(f"{r['name']:11} {r['transport']:4} {'1/' + str(r['scale']):>5} {spread(r['full']):>12} {spread(r['dec']):>12} "
              f"{spread(r['naive']):>12} {spread(r['agent']):>12} {r['ag_naive']:>8.2f} {r['ag_lim']:>6.2f} "
              f"{cpus:>22} {r['cpu_naive']:>5.2f} {r['seq']:>5.2f} {r['cpu_seq']:>6.2f} {r['rss']:>6.0f} {load:>9}"
              + ("" if r["results"] == args.frames else f"  ({r['results']}/{args.frames} results)"))
    print("\nCPU ms per frame in the steady state: each loop's first frames left out (the agent sizes its stages and "
          "plans its decoder over its first 56 results; every loop opens its session's buffers on its first runs):")
    print(f"{'input':11} {'via':4} {'from':>5} {'agent':>6} {'seq':>6} {'ag/seq':>6} {'ag/nv':>6}")
    for r in rows:
        print(f"{r['name']:11} {r['transport']:4} {r['warm']:>5} {r['st_cpu']:>6.2f} {r['st_seq_ms']:>6.2f} "
              f"{r['st_seq']:>6.2f} {r['st_naive']:>6.2f}")
    print("\nCPU ms per frame, sequential, one thread (the agent's stages one after the other; seq above):")
    for name, st in stages:
        print(f"  {name:16} " + "  ".join(f"{k} {v:.2f}" for k, v in st.items()) + f"  total {sum(st.values()):.2f}")
    print("\nfps everywhere, median [min-max] over runs; ratios are medians; dec full = cv2.VideoCapture.read alone "
          "(full-size BGR); dec agent = the agent's source with its decode and conversion at the scale shown, one "
          "thread; naive = cv2 read -> RGB -> preprocess -> run -> decode -> json, one thread; CPU ms/f = process CPU "
          "per frame (FFmpeg's threads counted), the agent's from /proc between its first and last result; "
          "limit = min(capture stage alone, cores / seq); load = 1-minute load average at the row's start and end")
    # The issue's targets beside what was measured (the bounds are the issue's, never derived from a run).
    for r in rows:
        if r["name"].startswith("1080p-h264"):
            want = 1.2 if args.detector else 1.5
            print(f"target {r['name']} {r['transport']}: agent >= {want}x naive: {r['ag_naive']:.2f} -> "
                  f"{'met' if r['ag_naive'] >= want else 'NOT met'}")
        for what, nv, sq in (("whole run", r["cpu_naive"], r["cpu_seq"]),
                             (f"steady, from frame {r['warm']}", r["st_naive"], r["st_seq"])):
            print(f"target {r['name']} {r['transport']}: agent CPU per frame ({what}) <= 1.05x the naive loop's: "
                  f"{nv:.2f} -> {'met' if nv <= 1.05 else 'NOT met'}; <= 1.05x the sequential stages': {sq:.2f} -> "
                  f"{'met' if sq <= 1.05 else 'NOT met'}")
    return 0


class MjpegViewer:
    """One person watching: polls /live until the page names a source, then reads its MJPEG stream until the agent
    ends (or `close`); counts the JPEG parts it received."""

    def __init__(self, port: int):
        self.port, self.parts, self._stop = port, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import urllib.request

        base = f"http://127.0.0.1:{self.port}"
        while not self._stop.is_set():
            try:
                page = urllib.request.urlopen(f"{base}/live", timeout=5).read().decode()
                if "/live/stream/" not in page:
                    time.sleep(0.2)  # no frame kept yet: the page asked for one
                    continue
                name = page.split("/live/stream/")[1].split(".mjpg")[0]
                with urllib.request.urlopen(f"{base}/live/stream/{name}.mjpg", timeout=10) as stream:
                    while not self._stop.is_set():
                        chunk = stream.read(65536)
                        if not chunk:
                            break
                        self.parts += chunk.count(b"--edgeagentframe")
            except OSError:
                time.sleep(0.2)  # not listening yet, or the agent ended

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def live_view_cost(args: argparse.Namespace) -> int:
    """The live view's cost: one video served off / on with nobody watching / on with one MJPEG viewer, the three
    interleaved in each run (a shared machine's load moves all three alike)."""
    h, w, codec = INPUTS[args.camera_input]
    args.bundle = args.bundle or DEMO_BUNDLE
    frames_from = ROOT / "calibration" / "digits" / "heldout.npz"
    bundle = load_bundle(args.bundle)
    modes = ("off", "unwatched", "one viewer")
    runs: dict[str, list[AgentRun]] = {m: [] for m in modes}
    loads: dict[str, list[float]] = {m: [] for m in modes}
    parts: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variant, raw = _variant_and_frames(bundle, args.variant, tmp, frames_from)
        video = camera_video(raw, h, w, args.frames, codec, tmp)
        warm = args.warm if args.warm is not None else max(60, args.frames // 10)
        for _ in range(args.runs):
            for mode in modes:
                # paced as a camera: a viewer watches a stream for seconds, not a file read in a blink
                settings: dict[str, object] = {"selection.variant": variant, "source.max_fps": args.camera_fps}
                viewer = None
                if mode != "off":
                    with socket.socket() as sock:
                        sock.bind(("127.0.0.1", 0))
                        port = sock.getsockname()[1]
                    settings.update({"metrics.listen": f"127.0.0.1:{port}", "metrics.live_view": True})
                    viewer = MjpegViewer(port) if mode == "one viewer" else None
                loads[mode].append(os.getloadavg()[0])
                try:
                    runs[mode].append(agent(video, args.bundle, variant, settings, args.frames, tmp, warm))
                finally:
                    if viewer is not None:
                        viewer.close()
                        parts.append(viewer.parts)
                loads[mode].append(os.getloadavg()[0])
    resize = bundle.manifest.preprocess.resize
    print(f"\nmodel {bundle.manifest.name} (variant {variant}, input {resize.width if resize else '-'}x"
          f"{resize.height if resize else '-'}), {args.frames} frames of {args.camera_input} (a file at {args.camera_fps:g} fps), "
          f"{CORES} cores, runs {args.runs} (the three modes interleaved in each run)")
    print("agent settings changed from the shipped defaults: --log-level warning; on: metrics.listen=127.0.0.1:<free>, "
          "metrics.live_view=true")
    print(f"{'live view':11} {'agent fps':>14} {'fps/off':>7} {'CPU ms/result':>22} {'CPU/off':>7} "
          f"{'steady CPU ms':>22} {'steady/off':>10} {'load':>9}")
    base = runs["off"]
    for mode in modes:
        rs = runs[mode]
        fps_ratio = statistics.median(r.fps / b.fps for r, b in zip(rs, base))
        cpu_ratio = statistics.median(r.cpu_ms / b.cpu_ms for r, b in zip(rs, base))
        st_ratio = statistics.median(r.steady_cpu_ms / b.steady_cpu_ms for r, b in zip(rs, base))
        print(f"{mode:11} {spread([r.fps for r in rs]):>14} {fps_ratio:>7.3f} "
              f"{spread_ms([r.cpu_ms for r in rs]):>22} {cpu_ratio:>7.3f} "
              f"{spread_ms([r.steady_cpu_ms for r in rs]):>22} {st_ratio:>10.3f} "
              f"{min(loads[mode]):>4.1f}-{max(loads[mode]):<4.1f}")
    print(f"one viewer received {', '.join(str(p) for p in parts)} MJPEG frames (per run; at most 5 a second)")
    print("ratios are medians of each run's mode against that run's off; CPU ms/result = the agent's process CPU "
          "between its first and last result; steady: from result {warm} on; load = 1-minute load average at the "
          "mode's start and end".replace("{warm}", str(warm)))
    print("target (issue 45): unwatched within the spread of off (no measurable change); one viewer bounded (at most "
          "5 frames a second copied, drawn and encoded)")
    return 0


def many_sources(args: argparse.Namespace) -> int:
    """N cameras at --camera-fps each through one agent: every camera served at its full rate? p95 capture to
    publish, peak RSS against the same agent serving one camera."""
    h, w, codec = INPUTS[args.camera_input]
    if args.rtsp and codec != "h264":
        raise SystemExit("--rtsp: the RTSP cameras send H.264 (--camera-input 720p-h264 or 1080p-h264)")
    if args.bundle is None:
        args.bundle, frames_from = yolo_bundle()
    else:
        frames_from = ROOT / "calibration" / "digits" / "heldout.npz"
    bundle = load_bundle(args.bundle)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        variant, raw = _variant_and_frames(bundle, args.variant, tmp, frames_from)
        videos: list[Path | str] = list(camera_videos(raw, h, w, args.frames, args.sources, tmp, codec))
        cameras = [RtspCamera(v, v.parent, args.camera_fps) for v in videos] if args.rtsp else []  # type: ignore[arg-type]
        if cameras:
            videos = [c.url for c in cameras]
        settings = {"selection.variant": variant,
                    **({"session.intra_op_threads": args.intra} if args.intra is not None else {}),
                    **{k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}}
        rows = []
        try:
            for _ in range(args.runs):
                rows.append((multi_agent(videos[:1], args.bundle, settings, args.camera_fps, tmp, args.frames),
                             multi_agent(videos, args.bundle, settings, args.camera_fps, tmp, args.frames)))
        finally:
            for c in cameras:
                c.close()
    resize = bundle.manifest.preprocess.resize
    print(f"\nmodel {bundle.manifest.name} (variant {variant}, input {resize.width if resize else '-'}x"
          f"{resize.height if resize else '-'}), {args.sources} x {args.camera_input} at {args.camera_fps:g} fps each "
          f"(frames from {frames_from.name}), {args.frames} frames per camera, {CORES} cores, runs {args.runs}")
    print("agent settings changed from the shipped defaults: --log-level warning, " +
          ", ".join(f"{k}={v}" for k, v in settings.items()) +
          (f"; RTSP cameras (tests/fixtures/rtsp_server.py) at {args.camera_fps:g} fps" if args.rtsp
           else f"; sources[].max_fps={args.camera_fps:g} (the camera rate)"))
    print(f"{'sources':>7} {'fps per source (min..max)':>26} {'results':>9} {'capture->publish p50/p95 ms':>27} "
          f"{'peak RSS MB':>11} {'RSS vs 1':>8} {'serving RSS':>11} {'vs 1':>5} {'CPU ms/result':>13} {'load before/after':>17}")
    for one, many in rows:
        for r in (one, many):
            f = list(r.fps.values())
            print(f"{r.sources:>7} {f'{min(f):.1f}..{max(f):.1f}':>26} {sum(r.results.values()):>9} {f'{r.p50_ms:.1f} / {r.p95_ms:.1f}':>27} "
                  f"{r.rss_mb:>11.0f} {r.rss_mb / one.rss_mb:>8.2f} {r.serving_rss_mb:>11.0f} "
                  f"{r.serving_rss_mb / one.serving_rss_mb:>5.2f} {r.cpu_ms:>13.2f} {f'{r.load[0]}/{r.load[1]}':>17}")
    # The issue's targets, each beside what was measured (the bounds are the issue's, never derived from a run).
    bound = 200 if args.rtsp else 150  # the H.264 RTSP row's bound (issue 24), the MJPEG row's (issue 15)
    for one, many in rows:
        f = list(many.fps.values())
        served = min(many.results.values()) if len(many.results) == args.sources else 0
        print(f"targets ({args.sources} sources): every source at full rate: slowest {min(f):.2f} fps of "
              f"{args.camera_fps:g}, {served}/{args.frames} results from the least served -> "
              f"{'met' if served >= args.frames and min(f) >= 0.97 * args.camera_fps else 'NOT met'}; "
              f"p95 capture->publish {many.p95_ms:.1f} ms < {bound} -> {'met' if many.p95_ms < bound else 'NOT met'}; "
              f"RSS {many.rss_mb / one.rss_mb:.2f} x one source < 1.3 -> "
              f"{'met' if many.rss_mb / one.rss_mb < 1.3 else 'NOT met'} (serving RSS {many.serving_rss_mb / one.serving_rss_mb:.2f}); "
              f"one source's peak RSS {one.rss_mb:.0f} MB < 200 -> {'met' if one.rss_mb < 200 else 'NOT met'} "
              f"(serving RSS {one.serving_rss_mb:.0f} MB -> {'met' if one.serving_rss_mb < 200 else 'NOT met'})")
    return 0


def yolo_bundle() -> tuple[Path, Path]:
    """The many-sources row's default: the YOLO-320 layout bundle (built once into the cache by
    scripts/yolo_resize.py) and the document frames its cameras show; the demo classifier when the cache lacks it."""
    bundle = LAYOUT / "bundle_320"
    frames = LAYOUT / "heldout.npz"
    if not (LAYOUT / "model.onnx").exists() or not frames.exists():
        print(f"note: no cached layout model ({LAYOUT}; python scripts/real_models.py fetch layout && "
              f"python scripts/real_models.py references layout): the many-sources row serves the demo classifier, "
              f"not the issue's YOLO-class detector")
        return DEMO_BUNDLE, ROOT / "calibration" / "digits" / "heldout.npz"
    if not (bundle / "bundle.yaml").exists():
        print(f"building {bundle} (scripts/yolo_resize.py bundle --size 320) ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "yolo_resize.py"), "bundle", "--size", "320"],
                       check=True, cwd=ROOT)
    return bundle, frames


if __name__ == "__main__":
    raise SystemExit(main())
