"""H.264 cameras decoded at the size the model needs: the decoder's 4:2:0 planes are reduced before any colour
conversion, the reduced frame keeps the full path's answers, boxes land in camera pixels, and the frozen
check looks at a small sample, never the full frame.

Videos are real (Debian's ffmpeg writes H.264), decoded by FFmpeg through PyAV; every wait is bounded.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from waiting import wait_until

from agent.config import SourceConfig
from agent.serving import ffmpeg_decode
from agent.serving.decoding import scaled_geometry
from agent.serving.sources import open_source
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.vocabulary.preprocess import fit_geometry
from agent.vocabulary.yuv import camera_sized_reduced_yuv, reduced_yuv_decode, yuv420_to_frame
from agentproc import AgentProcess, demo_config
from pipelines import read_frames

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
FFMPEG = shutil.which("ffmpeg")
RGB = FrameSpec(kind="image", height=160, width=160, channels=3, color="rgb")
SMALL_MODEL = ResizeSpec(width=128, height=128)
pytestmark = pytest.mark.skipif(FFMPEG is None or not ffmpeg_decode.available(),
                                reason="needs Debian's ffmpeg and PyAV (scripts/test.sh installs both)")


def encode_h264(path: Path, frames: list[np.ndarray], fps: int = 15) -> Path:
    """RGB frames -> an H.264 mp4 (libx264, yuv420p, as cameras send), through a raw pipe into Debian's ffmpeg."""
    h, w = frames[0].shape[:2]
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24",
                    "-s", f"{w}x{h}", "-r", str(fps), "-i", "-", "-c:v", "libx264", "-preset", "ultrafast",
                    "-qp", "12", "-threads", "1", "-pix_fmt", "yuv420p", "-y", str(path)],
                   input=b"".join(np.ascontiguousarray(f).tobytes() for f in frames), check=True, timeout=120)
    return path


def test_frozen_h264_picture_is_reported_from_a_small_sample_not_the_full_frame(tmp_path: Path) -> None:
    """The fault: np.array_equal on every full decoded frame in the serial capture thread (1.7 ms at 1080p).
    The check keeps a strided luma sample (8 kB at 1080p) and still sees a frozen picture, and a moving one."""
    still = encode_h264(tmp_path / "still.mp4", [np.full((1080, 1920, 3), 90, np.uint8)] * 14)
    source = open_source(SourceConfig(type="video", path=still, frozen_after=10), RGB, SMALL_MODEL)
    frames = read_frames(source, 14)
    assert len(frames) == 14
    assert source.stats.frozen_events == 1 and source.same >= 10
    assert source.prev is not None and source.prev.nbytes <= (1080 // 16 + 1) * (1920 // 16 + 1), source.prev.shape
    moving = [np.full((1080, 1920, 3), 90, np.uint8) for _ in range(14)]
    for i, f in enumerate(moving):
        cv2.rectangle(f, (100 * i, 200), (100 * i + 300, 600), (200, 30, 30), -1)  # a 300 px object moving
    source = open_source(SourceConfig(type="video", path=encode_h264(tmp_path / "moving.mp4", moving),
                                      frozen_after=10), RGB, SMALL_MODEL)
    assert len(read_frames(source, 14)) == 14
    assert source.stats.frozen_events == 0 and source.stats.state != "frozen"


def test_frozen_check_on_the_opencv_path_keeps_no_full_frame_alive(tmp_path: Path, monkeypatch) -> None:
    """Without PyAV (and for V4L2 cameras) frames come from cv2.VideoCapture: the check's sample was a
    strided view, so the previous full BGR frame (6 MB at 1080p) stayed alive per source after the pipeline
    had dropped it. The sample is a copy; a frozen picture is still seen."""
    monkeypatch.setattr(ffmpeg_decode, "available", lambda: False)
    still = encode_h264(tmp_path / "still.mp4", [np.full((720, 1280, 3), 90, np.uint8)] * 12)
    source = open_source(SourceConfig(type="video", path=still, frozen_after=10), RGB, SMALL_MODEL)
    assert len(read_frames(source, 12)) == 12
    assert not source.av and source.stats.frozen_events == 1
    assert source.prev is not None and source.prev.base is None, "the sample is a view into a full frame"
    assert source.prev.nbytes <= (720 // 16 + 1) * (1280 // 16 + 1) * 3, source.prev.shape


def test_reduced_planes_equal_the_full_conversion_area_reduced() -> None:
    """Area averaging commutes with the affine colour conversion: reducing the planes first gives the full
    conversion reduced, up to rounding inside the blocks of flat colour (at their edges the full path's
    chroma is interpolated up, the reduced one averaged down)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(30, 220, (9, 16, 3), dtype=np.uint8)
    raw = cv2.resize(blocks, (1920, 1080), interpolation=cv2.INTER_NEAREST)  # 120 px blocks of flat colour
    full = reduced_yuv_decode(raw, 1)
    for scale in (2, 4, 8):
        got = reduced_yuv_decode(raw, scale)
        want = cv2.resize(full, (1920 // scale, 1080 // scale), interpolation=cv2.INTER_AREA)
        assert got.shape == want.shape
        inside = np.ones(got.shape[:2], bool)
        step = 120 // scale
        for k in range(0, got.shape[0] + 1, step):
            inside[max(k - 2, 0):k + 2] = False
        for k in range(0, got.shape[1] + 1, step):
            inside[:, max(k - 2, 0):k + 2] = False
        assert np.abs(got.astype(int) - want)[inside].max() <= 2, scale
    assert np.abs(full.astype(int) - raw).mean() < 1.5  # the BT.601 round trip keeps the colours


def test_gray_and_bgr_bundles_get_their_colours_from_the_reduced_planes() -> None:
    rng = np.random.default_rng(1)
    raw = cv2.resize(rng.integers(30, 220, (9, 16, 3), dtype=np.uint8), (1280, 720), interpolation=cv2.INTER_NEAREST)
    rgb = reduced_yuv_decode(raw, 4)
    bgr = reduced_yuv_decode(raw[..., ::-1].copy(), 4, "bgr")
    assert np.abs(rgb.astype(int) - bgr[..., ::-1]).max() <= 1
    gray = reduced_yuv_decode(raw, 4, "gray")
    want = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    assert gray.shape == (180, 320) and np.abs(gray.astype(int) - want).mean() < 2.0


def test_golden_frames_through_the_reduced_video_path_keep_the_reference_answers(demo_bundle: Path) -> None:
    """What the self-test must run for the H.264 path: every golden frame, as an H.264 camera 2, 4 and 8 times
    its size delivers it through the reduced planes, gets the reference's top-1 class from the served variant."""
    from agent.bundle.load import load_bundle
    from agent.proof.session import open_session

    bundle = load_bundle(demo_bundle)
    pre = bundle.preprocessor()
    session = open_session(bundle.path(bundle.manifest.variant("int8").file), "CPUExecutionProvider")
    for ref in bundle.manifest.golden:
        with np.load(demo_bundle / ref) as z:
            key = "reference.logits" if "reference.logits" in z.files else "output.logits"
            raw, expected = z["raw"], int(np.argmax(z[key]))
        for scale in (2, 4, 8):
            frame = camera_sized_reduced_yuv(raw, scale)
            assert frame.shape == raw.shape
            assert int(np.argmax(session.run(pre(frame))["logits"])) == expected, (ref, scale)


def test_a_1080p_h264_frame_for_a_letterbox_detector_maps_boxes_to_camera_pixels(tmp_path: Path) -> None:
    """A 640 letterbox needs 360x640 of a 1080x1920 frame: the planes are reduced to 1/2 (1/4 would be too
    small), and the frame's geometry, scaled back, maps model boxes to the same camera pixels as full size."""
    letterbox = ResizeSpec(width=640, height=640, mode="letterbox")
    video = encode_h264(tmp_path / "cam.mp4", [np.full((1080, 1920, 3), 120, np.uint8)] * 2)
    frame = read_frames(open_source(SourceConfig(type="video", path=video), RGB, letterbox), 1)[0]
    assert frame.scale == 2 and frame.data.shape == (540, 960, 3)
    geometry = scaled_geometry(fit_geometry(*frame.data.shape[:2], letterbox), frame.scale)
    box = np.array([[100.0, 200.0, 300.0, 400.0]])
    assert np.allclose(geometry.to_frame(box), fit_geometry(1080, 1920, letterbox).to_frame(box))


def test_decode_scale_one_and_the_proven_limit_keep_the_full_size(tmp_path: Path) -> None:
    video = encode_h264(tmp_path / "cam.mp4", [np.full((720, 1280, 3), 60, np.uint8)] * 2)
    full = read_frames(open_source(SourceConfig(type="video", path=video, decode_scale=1), RGB, SMALL_MODEL), 1)[0]
    assert full.scale == 1 and full.data.shape == (720, 1280, 3)
    capped = read_frames(open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL, max_scale=2), 1)[0]
    assert capped.scale == 2  # 1/4 would do for the model, but the self-test proved 1/2 only


def test_without_pyav_video_falls_back_to_opencv_at_full_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    video = encode_h264(tmp_path / "cam.mp4", [np.full((720, 1280, 3), 60, np.uint8)] * 2)
    monkeypatch.setattr(ffmpeg_decode, "available", lambda: False)  # the binding not installed
    source = open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL)
    frame = read_frames(source, 1)[0]
    assert frame.scale == 1 and frame.data.shape == (720, 1280, 3)
    assert source.stats.decoder["path"] == "ffmpeg" and "binding" not in source.stats.decoder


def test_the_planes_are_views_of_the_decoders_frame(tmp_path: Path) -> None:
    video = encode_h264(tmp_path / "cam.mp4", [np.full((720, 1280, 3), 60, np.uint8)] * 2)
    source = open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL)
    frame = read_frames(source, 1)[0]
    vf = frame._data  # the capture thread's hand-over: the decoder's frame itself, not a converted copy
    y, u, v = ffmpeg_decode.planes(vf)
    assert y.shape == (720, 1280) and u.shape == (360, 640) and not y.flags.owndata
    assert np.array_equal(frame.data, yuv420_to_frame(y, u, v, 4))


@pytest.mark.slow
def test_1080p_h264_is_served_at_reduced_scale_and_agrees_with_full_decode(tmp_path: Path) -> None:
    """Two real `edge-agent run` processes on one 1080p H.264 video of the demo's digits: reduced (auto) and
    full (decode_scale 1) give the same classes on every frame."""
    pngs = sorted((ROOT / "models" / "demo-frames" / "digits").glob("*.png"))[:16]
    frames = [cv2.resize(cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB), (1920, 1080),
                         interpolation=cv2.INTER_CUBIC) for p in pngs]
    video = encode_h264(tmp_path / "digits.mp4", frames)
    runs = {}
    for name, extra in (("auto", {}), ("full", {"decode_scale": 1})):
        cfg = demo_config(tmp_path / name, bundle=str(DEMO))
        cfg["source"] = {"type": "video", "path": str(video), **extra}
        agent = AgentProcess(tmp_path / name, cfg)
        t0 = time.monotonic()
        assert agent.run(240) == 0, agent.log_text()[-3000:]
        runs[name] = agent.results()
        scales = [e["scale"] for e in agent.events("source.decode_scale")]
        assert scales == ([8] if name == "auto" else []), (name, scales, time.monotonic() - t0)
    assert len(runs["auto"]) == len(runs["full"]) == 16
    top = lambda rs: [r["result"]["top"][0]["label"] for r in sorted(rs, key=lambda r: r["frame_index"])]
    assert top(runs["auto"]) == top(runs["full"])


def test_decoder_threads_are_shared_among_many_streams_and_a_configured_count_is_kept(tmp_path: Path) -> None:
    """Each FFmpeg frame thread holds a decoding context and its frames (about 25 MB at 1080p): one stream
    takes at most 2, many streams share the cores, and a configured decoder_threads is what runs."""
    import os

    from agent.serving.multisource import MultiSource

    video = encode_h264(tmp_path / "cam.mp4", [np.full((360, 640, 3), 60, np.uint8)] * 4)
    one = open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL)
    read_frames(one, 1)
    assert one.stats.decoder["threads"] == min(len(os.sched_getaffinity(0)), 2)
    cfgs = [SourceConfig(type="video", path=video, name=f"cam{i}") for i in range(4)]
    cfgs.append(SourceConfig(type="video", path=video, name="pinned", decoder_threads=3))
    sources = [open_source(c, RGB, SMALL_MODEL) for c in cfgs]
    multi = MultiSource(list(zip(cfgs, sources)))
    stop = threading.Event()
    try:
        got = [multi.read(stop) for _ in range(5)]
        assert wait_until(lambda: all("threads" in s.stats.decoder for s in sources), timeout=30), \
            [s.stats for s in sources]
    finally:
        stop.set()
        multi.close()
    assert all(f is not None for f in got)
    share = max(1, len(os.sched_getaffinity(0)) // 5)
    assert [s.stats.decoder["threads"] for s in sources] == [share] * 4 + [3]
