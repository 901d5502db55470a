"""FFmpeg's decoder threads sized by the stage planner, and hardware decoding through PyAV that falls back.

The plan is arithmetic over measured costs (tested with numbers); the sources and the pipeline decode real
H.264 files that Debian's ffmpeg writes, through PyAV: a decoder given more threads mid-file swaps at a
keyframe and delivers every frame once, in order, bit for bit what a plain decode gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from agent.bundle.load import load_bundle
from agent.config import PipelineConfig, SourceConfig
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.serving import ffmpeg_decode
from agent.serving.engine import build_engine
from agent.serving.pipeline import Pipeline
from agent.serving.pipeline_publish import SIZING_FRAMES, SIZING_WARMUP
from agent.serving.sizing import DecoderLoad, StageCosts, plan_decoders, plan_stages
from agent.serving.sources import is_lossless, open_source
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.testing import ListSink

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"
FFMPEG = shutil.which("ffmpeg")
RGB = FrameSpec(kind="image", height=160, width=160, channels=3, color="rgb")
SMALL_MODEL = ResizeSpec(width=128, height=128)
FULL_HD = 1920 * 1080
needs_video = pytest.mark.skipif(FFMPEG is None or not ffmpeg_decode.available(),
                                 reason="needs Debian's ffmpeg and PyAV (scripts/test.sh installs both)")

# the costs the planner logged for a 720p H.264 file on 2 cores, where the agent served 0.86x the plain loop
H264_720P = StageCosts(0.18, 0.56, 0.86, 0.13, 48, other_ms=3.23)


# -- the plan ---------------------------------------------------------------------------------------------

def test_a_decode_bound_stream_gets_threads_for_the_pace_up_to_cores_plus_one() -> None:
    slow = DecoderLoad("cam", threads=2, wait_ms=5.5, pixels=FULL_HD)  # 182 fps where the cores allow 403
    plan = plan_stages(H264_720P, cores=2, sources=1, preprocess_max=2, inference_max=2, fused=True, decoders=[slow])
    (d,) = plan.decoders
    assert (d.was, d.threads) == (2, 3)
    assert d.reason.startswith("decode-bound: 182 fps at 2 threads") and "capped at cores + 1 (3)" in d.reason
    # its ceiling at 3 threads is the decode stage's, and it is what sets the pace now
    assert plan.limits_fps["decode"] == pytest.approx(182 * 3 / 2, rel=0.01)
    assert plan.bottleneck == "decode" and "decoder cam: 3 threads" in plan.reason
    json.dumps(plan.to_dict(), allow_nan=False)


def test_a_decoder_that_keeps_up_with_the_pace_keeps_its_threads() -> None:
    quick = DecoderLoad("cam", threads=2, wait_ms=0.4, pixels=FULL_HD)  # 2500 fps: never the one waited for
    (d,) = plan_decoders([quick], pace_fps=403, cores=2, sources=1)
    assert d.threads == 2 and "at least 1.2 x its share of the pace (403 fps)" in d.reason


def test_a_decoder_that_only_just_keeps_up_gets_headroom_as_a_pool_does() -> None:
    """Sized like a pool: threads for 1.2 x the pace, so the first jitter does not make it the bottleneck."""
    (d,) = plan_decoders([DecoderLoad("cam", 2, 1000 / 400, FULL_HD)], pace_fps=400, cores=8, sources=1)
    assert d.threads == 3


def test_a_configured_count_and_a_hardware_decoder_are_kept() -> None:
    pinned = DecoderLoad("pinned", threads=1, wait_ms=20, pixels=FULL_HD, fixed=True)
    device = DecoderLoad("gpu", threads=1, wait_ms=20, pixels=FULL_HD, hw=True)
    p, g = plan_decoders([pinned, device], pace_fps=400, cores=2, sources=2)
    assert (p.threads, g.threads) == (1, 1)
    assert p.reason == "configured (source.decoder_threads)" and g.reason == "decoded by the device"


def test_decoder_threads_stay_within_the_memory_budget() -> None:
    """About 25 MB per 1080p frame thread: a 4K decoder's thread is 100 MB, the whole budget."""
    (d,) = plan_decoders([DecoderLoad("4k", 1, 20, 4 * FULL_HD)], pace_fps=400, cores=4, sources=1)
    assert d.threads == 1 and "memory budget (100 MB)" in d.reason
    (d,) = plan_decoders([DecoderLoad("hd", 1, 20, FULL_HD)], pace_fps=400, cores=8, sources=1)
    assert d.threads == 4 and "memory budget" in d.reason  # 4 x 25 MB


def test_many_decode_bound_streams_share_the_cores_the_most_starved_first() -> None:
    four = [DecoderLoad(f"cam{i}", 1, 30, 1280 * 720) for i in range(4)]  # the open share: 1 each on 2 cores
    assert [d.threads for d in plan_decoders(four, pace_fps=400, cores=2, sources=4)] == [1, 1, 1, 1]
    assert "hold 4 threads on 2 cores" in plan_decoders(four, pace_fps=400, cores=2, sources=4)[0].reason
    slow, quick = DecoderLoad("slow", 1, 30, FULL_HD), DecoderLoad("quick", 1, 12, FULL_HD)
    q, s = plan_decoders([quick, slow], pace_fps=400, cores=2, sources=2)
    assert (s.threads, q.threads) == (2, 1)  # one thread to spare (cores + 1): the slower decoder takes it


def test_without_decoders_the_plan_is_what_it_was() -> None:
    kw = dict(cores=2, sources=1, preprocess_max=2, inference_max=2, fused=True)
    assert plan_stages(H264_720P, **kw) == plan_stages(H264_720P, decoders=[], **kw)  # type: ignore[arg-type]
    assert plan_stages(H264_720P, **kw).to_dict()["decoders"] == []  # type: ignore[arg-type]


# -- real decoders ----------------------------------------------------------------------------------------

def camera_h264(path: Path, w: int, h: int, frames: int) -> Path:
    """A camera-like H.264 file: sensor noise (a high bitrate, a costly decode), a keyframe every 10 frames, no
    B-frames, as cameras send."""
    if FFMPEG is None or not ffmpeg_decode.available():
        pytest.skip("needs Debian's ffmpeg and PyAV (scripts/test.sh installs both)")
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
                    f"testsrc2=size={w}x{h}:rate=30,noise=alls=10:allf=t", "-frames:v", str(frames), "-c:v", "libx264",
                    "-preset", "veryfast", "-tune", "zerolatency", "-g", "10", "-bf", "0", "-threads", "2",
                    "-pix_fmt", "yuv420p", "-y", str(path)], check=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def hd_h264(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return camera_h264(tmp_path_factory.mktemp("h264") / "cam-720p.mp4", 1280, 720, 48)


def _plain_decode(path: Path) -> list[str]:
    """Each frame's luma, hashed, as one PyAV decoder with its own threads gives them."""
    import av

    with av.open(str(path)) as c:
        return [_luma(f) for f in c.decode(c.streams.video[0])]


def _luma(frame: object) -> str:
    y = ffmpeg_decode.planes(frame)[0]
    return hashlib.sha1(y.tobytes()).hexdigest()


@needs_video
def test_a_decoder_given_more_threads_mid_file_swaps_at_a_keyframe_and_loses_no_frame(hd_h264: Path) -> None:
    want = _plain_decode(hd_h264)
    source = open_source(SourceConfig(type="video", path=hd_h264), RGB, SMALL_MODEL)
    stop = threading.Event()
    got, indices, threads = [], [], []
    try:
        while (f := source.read(stop)) is not None:
            got.append(_luma(f._data))  # the decoder's own frame, before any conversion
            indices.append(f.index)
            threads.append(source.stats.decoder["threads"])
            if len(got) == 23:  # between two keyframes: the swap waits for frame 31
                source.plan_decoder(3, "a test's plan")
    finally:
        source.close()
    opened = min(len(os.sched_getaffinity(0)), 2)
    assert got == want and indices == list(range(1, len(want) + 1))
    # one swap, at the keyframe after the plan (frame 31; the frame threads had read a frame or two ahead)
    swapped_at = threads.index(3) + 1
    assert threads[:23] == [opened] * 23 and set(threads[swapped_at - 1:]) == {3} and 24 <= swapped_at <= 31
    assert source.cap is None and source.stats.decoder["threads_planned"] == 3
    assert source.stats.decoder["threads_why"] == "a test's plan"


@needs_video
@pytest.mark.slow  # 1080p: 20-40 s on 2 loaded cores
def test_a_decode_bound_full_hd_stream_ends_with_more_decoder_threads_and_every_result_in_order(
        tmp_path: Path) -> None:
    full_hd_h264 = camera_h264(tmp_path / "cam-1080p.mp4", 1920, 1080, SIZING_WARMUP + SIZING_FRAMES + 24)
    b = load_bundle(DEMO)
    variant = b.manifest.variants[0]
    engine = build_engine(b, Candidate(CPU, variant.name, variant.precision), SessionSettings())
    scfg = SourceConfig(type="video", path=full_hd_h264)
    source = open_source(scfg, b.manifest.frame, b.manifest.preprocess.resize)
    sink = ListSink()
    p = Pipeline(source, engine, sink, PipelineConfig(), is_lossless(scfg, source)).start()
    try:
        assert p.done.wait(240), "the pipeline did not finish the video"
        assert p.join(timeout=15)
    finally:
        source.close()
    n = len(_plain_decode(full_hd_h264))
    assert p.failed is None and [r["frame_index"] for r in sink.results] == list(range(1, n + 1))
    opened = min(len(os.sched_getaffinity(0)), 2)
    stages = p.status().metrics["stages"]
    (d,) = stages["decoders"]
    # the one decoder: measured waiting for FFmpeg, given more threads, and running them by the end
    assert d["was"] == opened and d["threads"] > opened and d["reason"].startswith("decode-bound"), d
    assert source.stats.decoder["threads"] == d["threads"] == source.stats.decoder["threads_planned"]
    assert f"decoder {d['source']}: {d['threads']} threads" in stages["reason"]


@needs_video
def test_hardware_decode_asked_for_where_there_is_no_device_decodes_in_software_and_says_why(
        hd_h264: Path) -> None:
    if Path("/dev/dri").exists() or Path("/dev/nvidia0").exists():
        pytest.skip("a GPU device node is here: this pins the fallback where there is none")
    for hw in ("vaapi", "cuda", "v4l2m2m", "any"):
        source = open_source(SourceConfig(type="video", path=hd_h264, hw_decode=hw), RGB, SMALL_MODEL)
        stop = threading.Event()
        try:
            frames = [source.read(stop) for _ in range(3)]
        finally:
            source.close()
        assert all(f is not None and f.data.shape == (180, 320, 3) for f in frames)  # served, reduced to 1/4
        dec = source.stats.decoder
        assert (dec["path"], dec["binding"], dec["hw_requested"], dec["hw"]) == ("ffmpeg", "pyav", hw, "none")
        assert dec["hw_fallback"] and dec["hw_fallback"] != "not tried yet", dec
        if hw != "any":
            assert dec["hw_fallback"].startswith("cuda" if hw == "cuda" else hw), dec


@needs_video
def test_a_live_rtsp_camera_takes_its_new_decoder_at_a_keyframe_without_reconnecting(tmp_path: Path) -> None:
    """A camera serving one client (ffmpeg -listen 1, many cameras) would refuse a second connection: the
    decoder is replaced on the connection it has."""
    import socket
    import sys

    from waiting import end_process

    es = tmp_path / "cam.h264"  # Annex B, one slice per frame, a keyframe every 15 frames
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc2=size=640x360:rate=30",
                    "-frames:v", "60", "-c:v", "libx264", "-preset", "ultrafast", "-threads", "1", "-g", "15",
                    "-bf", "0", "-pix_fmt", "yuv420p", "-f", "h264", "-y", str(es)], check=True, timeout=60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "fixtures" / "rtsp_server.py"), str(port),
                               str(es), "--fps", "60"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    source = open_source(SourceConfig(type="stream", url=f"rtsp://127.0.0.1:{port}/cam", open_timeout_ms=5000,
                                      read_timeout_ms=3000), RGB, SMALL_MODEL)
    stop = threading.Event()
    timer = threading.Timer(60, stop.set)
    timer.start()
    threads = []
    try:
        while len(threads) < 40 and source.read(stop) is not None:
            threads.append(source.stats.decoder["threads"])
            if len(threads) == 3:
                source.plan_decoder(3, "a test's plan")
    finally:
        timer.cancel()
        source.close()
        end_process(server, graceful=False)
    assert len(threads) == 40 and threads[-1] == 3 and threads[0] == min(len(os.sched_getaffinity(0)), 2)
    assert source.stats.reconnects == 0 and source.stats.losses == 0
