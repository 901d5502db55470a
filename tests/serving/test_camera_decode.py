"""Camera-sized frames: JPEG decoded at the scale the model needs, FFmpeg decoding, real RTSP and HTTP cameras.

Videos and streams are real: OpenCV writes MJPEG, Debian's ffmpeg writes H.264, tests/fixtures serve
them over HTTP (MJPEG) and RTSP (H.264 over RTP). Every wait is bounded.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

import yaml

from agent.config import SourceConfig, parse_config
from agent.serving.decoding import camera_sized_reduced, jpeg_size, max_decode_scale, reduced_decode, scaled_geometry
from agent.serving.sources import Frame, open_source
from agent.vocabulary.manifest import FrameSpec, ResizeSpec
from agent.vocabulary.preprocess import fit_geometry
from waiting import end_process, wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RGB = FrameSpec(kind="image", height=160, width=160, channels=3, color="rgb")
SMALL_MODEL = ResizeSpec(width=128, height=128)  # the demo classifier's input
FFMPEG = shutil.which("ffmpeg")
needs_ffmpeg = pytest.mark.skipif(FFMPEG is None, reason="Debian's ffmpeg is not installed (scripts/test.sh installs it)")


def scene(h: int, w: int, i: int = 0) -> np.ndarray:
    """A camera-like RGB picture: smooth gradients, edges and a frame number."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w * 255, y / h * 255, (x + y + 40 * i) % 255], axis=-1).astype(np.uint8)
    cv2.rectangle(img, (w // 5, h // 5), (w // 2, h // 2), (20, 200, 90), -1)
    cv2.putText(img, str(i), (w // 2, 3 * h // 4), cv2.FONT_HERSHEY_SIMPLEX, h / 200, (255, 255, 255), max(h // 100, 1))
    return img


def write_mjpeg(path: Path, h: int, w: int, n: int, fps: int = 30) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert writer.isOpened()
    for i in range(n):
        writer.write(cv2.cvtColor(scene(h, w, i), cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def write_h264(path: Path, h: int, w: int, seconds: float, fps: int = 15, annexb: bool = False) -> Path:
    fmt = ["-f", "h264"] if annexb else []
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", f"testsrc2=size={w}x{h}:rate={fps}",
                    "-t", str(seconds), "-c:v", "libx264", "-threads", "1", "-preset", "ultrafast", "-g", str(fps),
                    "-pix_fmt", "yuv420p", *fmt, "-y", str(path)], check=True, timeout=60)
    return path


def read_frames(source, n: int, timeout: float = 60.0) -> list[Frame]:
    """Up to n frames, never waiting past `timeout` (a timer sets the source's stop event)."""
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    frames = []
    try:
        while len(frames) < n:
            f = source.read(stop)
            if f is None:
                break
            frames.append(f)
    finally:
        timer.cancel()
    return frames


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the decode scale ------------------------------------------------------------------------------------

def test_jpeg_header_gives_the_frame_size_without_decoding() -> None:
    img = scene(1080, 1920)
    for params in ([], [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]):
        enc = cv2.imencode(".jpg", img, params)[1]
        assert jpeg_size(enc) == (1080, 1920)
        assert jpeg_size(enc.tobytes()) == (1080, 1920)
    assert jpeg_size(cv2.imencode(".png", img[:10, :10])[1]) is None
    assert jpeg_size(b"\xff\xd8\xff") is None
    assert jpeg_size(b"") is None


def test_decode_scale_is_the_largest_the_models_resize_allows() -> None:
    assert max_decode_scale(SMALL_MODEL, 1080, 1920) == 8  # 240x135 still covers 128x128
    assert max_decode_scale(SMALL_MODEL, 720, 1280) == 4  # 320x180 (1/8 would be 90 rows)
    assert max_decode_scale(SMALL_MODEL, 160, 160) == 1
    assert max_decode_scale(None, 1080, 1920) == 1  # no resize: the model takes the frame as it is
    letterbox = ResizeSpec(width=640, height=640, mode="letterbox")
    assert max_decode_scale(letterbox, 1080, 1920) == 2  # the fitted picture is 640x360: 960x540 covers it
    assert max_decode_scale(ResizeSpec(width=320, height=320, mode="letterbox"), 720, 1280) == 4


def test_config_takes_the_decode_options() -> None:
    cfg = parse_config(yaml.safe_dump({"source": {"type": "stream", "url": "rtsp://cam/x", "name": "porch",
                                                   "decode_scale": 2, "decoder_threads": 2, "hw_decode": "vaapi"}}),
                       "agent.yaml")
    assert (cfg.source.name, cfg.source.decode_scale, cfg.source.decoder_threads, cfg.source.hw_decode) == \
        ("porch", 2, 2, "vaapi")
    assert parse_config("{}", "agent.yaml").source.decode_scale == "auto"


# -- faults: full-size decode and full-size colour conversion in the capture thread ---------------------

def test_full_hd_mjpeg_video_for_a_small_model_is_not_decoded_at_full_size(tmp_path: Path) -> None:
    video = write_mjpeg(tmp_path / "cam.avi", 1080, 1920, 4)
    source = open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL)
    try:
        frames = read_frames(source, 4)
    finally:
        source.close()
    assert len(frames) == 4
    assert frames[0].scale == 8 and frames[0].data.shape == (135, 240, 3)
    assert source.stats.decoder["path"] == "jpeg" and source.stats.decoder["scale"] == 8
    # decoded by the first reader of `data` (the preprocessing pool, on as many cores as it is sized to)
    assert "converted=False" in repr(frames[3])
    # the same picture as a full decode shrunk to that size, in RGB (decoded straight into the bundle's colours)
    full = cv2.cvtColor(cv2.VideoCapture(str(video)).read()[1], cv2.COLOR_BGR2RGB)
    shrunk = cv2.resize(full, (240, 135), interpolation=cv2.INTER_AREA)
    assert np.abs(frames[0].data.astype(int) - shrunk).mean() < 3


def test_auto_decode_scale_stays_within_what_the_selftest_proved(tmp_path: Path) -> None:
    video = write_mjpeg(tmp_path / "cam.avi", 1080, 1920, 1)
    frame = read_frames(open_source(SourceConfig(type="video", path=video), RGB, SMALL_MODEL, max_scale=2), 1)[0]
    assert frame.scale == 2 and frame.data.shape == (540, 960, 3)
    forced = read_frames(open_source(SourceConfig(type="video", path=video, decode_scale=4), RGB, None), 1)[0]
    assert forced.scale == 4  # a scale the user names is used as given


def test_full_hd_h264_frame_is_not_colour_converted_in_the_capture_thread(tmp_path: Path) -> None:
    """H.264 cannot be decoded at reduced scale, but its colour conversion can: the capture thread hands over
    the decoder's frame as it is, and the first reader gets it at the scale the model needs (1/8 here), close
    to the full-size picture (cv2.VideoCapture's) area-reduced."""
    if FFMPEG is None:
        pytest.skip("Debian's ffmpeg is not installed (scripts/test.sh installs it)")
    video = write_h264(tmp_path / "cam.mp4", 1080, 1920, 0.2)
    source = open_source(SourceConfig(type="video", path=video, decoder_threads=2), RGB, SMALL_MODEL)
    try:
        frame = read_frames(source, 1)[0]
    finally:
        source.close()
    assert source.stats.decoder["path"] == "ffmpeg" and source.stats.decoder["codec"] in ("avc1", "h264")
    assert source.stats.decoder["threads"] == 2 and source.stats.decoder["binding"] == "pyav"
    assert "converted=False" in repr(frame)  # the capture thread handed over FFmpeg's frame as it was
    assert frame.scale == 8 and frame.data.shape == (135, 240, 3)  # converted on first use, at 1/8
    assert "converted=True" in repr(frame)
    bgr = cv2.VideoCapture(str(video)).read()[1]
    full = cv2.resize(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), (240, 135), interpolation=cv2.INTER_AREA)
    assert np.abs(frame.data.astype(int) - full).mean() < 2.0  # the same picture, up to chroma interpolation
    whole = read_frames(open_source(SourceConfig(type="video", path=video, decode_scale=1), RGB, SMALL_MODEL), 1)[0]
    assert np.array_equal(whole.data, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))  # full size: FFmpeg's own picture


# -- the reduced path is reproducible, and geometry maps back --------------------------------------------

def test_reduced_decode_reproduces_what_a_jpeg_folder_source_delivers(tmp_path: Path) -> None:
    raws = [scene(720, 1280, i) for i in range(3)]
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, raw in enumerate(raws):
        cv2.imwrite(str(folder / f"{i:03d}.jpg"), cv2.cvtColor(raw, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    source = open_source(SourceConfig(type="folder", path=folder), RGB, SMALL_MODEL)
    frames = read_frames(source, 3)
    assert [f.scale for f in frames] == [4, 4, 4]
    for raw, frame in zip(raws, frames):
        assert np.array_equal(frame.data, reduced_decode(raw, 4, "rgb", quality=95))


def test_png_folder_frames_are_decoded_at_full_size(tmp_path: Path) -> None:
    folder = tmp_path / "frames"
    folder.mkdir()
    cv2.imwrite(str(folder / "000.png"), scene(720, 1280))
    frames = read_frames(open_source(SourceConfig(type="folder", path=folder), RGB, SMALL_MODEL), 1)
    assert frames[0].scale == 1 and frames[0].data.shape == (720, 1280, 3)


def test_decode_scale_one_keeps_full_size_and_gray_bundles_decode_gray(tmp_path: Path) -> None:
    video = write_mjpeg(tmp_path / "cam.avi", 720, 1280, 2)
    full = read_frames(open_source(SourceConfig(type="video", path=video, decode_scale=1), RGB, SMALL_MODEL), 1)[0]
    assert full.scale == 1 and full.data.shape == (720, 1280, 3)
    gray = FrameSpec(kind="image", height=160, width=160, channels=1, color="gray")
    g = read_frames(open_source(SourceConfig(type="video", path=video), gray, SMALL_MODEL), 1)[0]
    assert g.scale == 4 and g.data.shape == (180, 320)


def test_boxes_found_on_a_reduced_frame_map_back_to_full_frame_pixels() -> None:
    letterbox = ResizeSpec(width=640, height=640, mode="letterbox")
    full = fit_geometry(1080, 1920, letterbox)
    reduced = scaled_geometry(fit_geometry(540, 960, letterbox), 2)
    box = np.array([[100.0, 200.0, 300.0, 400.0]])  # model pixels
    assert np.allclose(reduced.to_frame(box), full.to_frame(box))
    assert np.allclose(full.to_frame(box), [[300.0, 180.0, 900.0, 780.0]])


def test_reduced_decode_of_a_golden_frame_keeps_the_classifier_answer(demo_bundle: Path) -> None:
    """What the self-test's preprocessing check does for the reduced path: a camera-sized golden frame,
    JPEG-encoded and decoded at the scale serving will use, preprocessed, stays close to the full path."""
    from agent.bundle.load import load_bundle

    bundle = load_bundle(demo_bundle)
    pre = bundle.preprocessor()
    with np.load(demo_bundle / bundle.manifest.golden[0]) as z:
        raw = z["raw"]
    camera = cv2.resize(raw, (1280, 720), interpolation=cv2.INTER_CUBIC)  # the digit as a 720p camera sees it
    scale = max_decode_scale(bundle.manifest.preprocess.resize, 720, 1280)
    assert scale == 4
    full = pre(reduced_decode(camera, 1))
    reduced = pre(reduced_decode(camera, scale))
    assert reduced.shape == full.shape
    cos = float(np.dot(full.ravel(), reduced.ravel()) / np.linalg.norm(full) / np.linalg.norm(reduced))
    assert cos > 0.99, cos


def test_golden_frames_through_the_reduced_path_keep_the_reference_answers(demo_bundle: Path) -> None:
    """The check the self-test runs per scale: every golden frame, as a camera 2, 4 and 8 times its size
    delivers it through the reduced path, gets the reference's top-1 class from the served variant."""
    from agent.bundle.load import load_bundle
    from agent.proof.session import open_session

    bundle = load_bundle(demo_bundle)
    pre = bundle.preprocessor()
    session = open_session(bundle.path(bundle.manifest.variant("int8").file), "CPUExecutionProvider")
    for ref in bundle.manifest.golden:
        with np.load(demo_bundle / ref) as z:
            key = "reference.logits" if "reference.logits" in z.files else "output.logits"  # the newer name first
            raw, expected = z["raw"], int(np.argmax(z[key]))
        for scale in (2, 4, 8):
            frame = camera_sized_reduced(raw, scale)
            assert frame.shape == raw.shape
            assert int(np.argmax(session.run(pre(frame))["logits"])) == expected, (ref, scale)


# -- real streams ---------------------------------------------------------------------------------------

class Server:
    """A fixture camera process (tests/fixtures), killed and restarted on the same port."""

    def __init__(self, script: str, *args: str):
        self.script, self.args = script, args
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.proc = subprocess.Popen([sys.executable, str(FIXTURES / self.script), *self.args],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def kill(self) -> None:
        end_process(self.proc, graceful=False)


def test_http_mjpeg_stream_is_decoded_from_its_jpeg_packets_at_reduced_scale() -> None:
    port = free_port()
    cam = Server("mjpeg_server.py", str(port)).start()  # 160x120 pictures
    source = open_source(SourceConfig(type="stream", url=f"http://127.0.0.1:{port}/s.mjpg", open_timeout_ms=2000,
                                      read_timeout_ms=1000), RGB, ResizeSpec(width=64, height=48))
    try:
        frames = read_frames(source, 5)
    finally:
        cam.kill()
        source.close()
    assert len(frames) == 5
    # a live camera hands frames over latest-wins: decoding waits for the stage that uses the frame
    assert all("converted=False" in repr(f) for f in frames) and source.stats.decoder["deferred"]
    assert {f.scale for f in frames} == {2} and frames[0].data.shape == (60, 80, 3)
    assert source.stats.decoder["path"] == "jpeg" and source.stats.decoder["codec"] == "MJPG"


@needs_ffmpeg
def test_rtsp_h264_stream_lost_is_reported_and_resumes_when_the_server_returns(tmp_path: Path) -> None:
    video = write_h264(tmp_path / "cam.h264", 360, 640, 2, fps=15, annexb=True)
    port = free_port()
    cam = Server("rtsp_server.py", str(port), str(video), "--fps", "15").start()
    cfg = SourceConfig(type="stream", url=f"rtsp://127.0.0.1:{port}/cam", name="porch", open_timeout_ms=5000,
                       read_timeout_ms=1500, reconnect_initial_s=0.2, reconnect_max_s=0.5)
    source = open_source(cfg, RGB, SMALL_MODEL)
    stop = threading.Event()
    frames: list[Frame] = []

    def capture() -> None:
        while not stop.is_set():
            f = source.read(stop)
            if f is None:
                return
            frames.append(f)

    reader = threading.Thread(target=capture, daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: len(frames) >= 10, timeout=60), f"no frames from RTSP: {source.stats}"
        assert source.name == "porch" and frames[0].source == "porch"
        # 640x360 for a 128x128 model: the planes reduced to 1/2 before any conversion
        assert frames[0].data.shape == (180, 320, 3) and source.stats.decoder["codec"] == "h264"
        assert frames[0].scale == 2
        cam.kill()
        assert wait_until(lambda: source.stats.state == "lost", timeout=30), f"state {source.stats.state}"
        assert source.stats.losses == 1
        served_while_down = len(frames)
        cam = Server("rtsp_server.py", str(port), str(video), "--fps", "15").start()
        assert wait_until(lambda: len(frames) > served_while_down + 10, timeout=60), f"not resumed: {source.stats}"
        assert source.stats.reconnects >= 1 and source.stats.state == "open"
    finally:
        stop.set()
        cam.kill()
        reader.join(timeout=15)
        source.close()
    assert not reader.is_alive()


def test_hardware_decode_requested_where_there_is_none_falls_back_to_software_and_says_so(tmp_path: Path) -> None:
    video = write_mjpeg(tmp_path / "cam.avi", 120, 160, 2)
    for hw in ("any", "vaapi"):
        source = open_source(SourceConfig(type="video", path=video, hw_decode=hw), RGB, None)
        frames = read_frames(source, 2)
        source.close()
        assert len(frames) == 2
        assert source.stats.decoder["hw_requested"] == hw
        if not Path("/dev/dri").exists():  # no GPU device node: nothing to accelerate with
            assert source.stats.decoder["hw"] == "none"


@needs_ffmpeg
@pytest.mark.parametrize("fmt, codec, scale", [("mpjpeg", "mjpeg", 2), ("mpegts", "libx264", 2)])
def test_http_stream_served_by_ffmpeg_is_read_at_the_scale_its_codec_allows(fmt: str, codec: str, scale: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/cam"
    enc = ["-c:v", codec, "-q:v", "5"] if codec == "mjpeg" else ["-c:v", codec, "-preset", "ultrafast", "-g", "15",
                                                                 "-pix_fmt", "yuv420p"]
    server = subprocess.Popen([FFMPEG, "-hide_banner", "-loglevel", "quiet", "-re", "-f", "lavfi", "-i",
                               "testsrc2=size=640x360:rate=15", *enc, "-f", fmt, "-listen", "1", url])
    # the source retries while ffmpeg starts listening (ffmpeg -listen 1 serves exactly one client: no probing)
    source = open_source(SourceConfig(type="stream", url=url, open_timeout_ms=2000, read_timeout_ms=2000,
                                      reconnect_initial_s=0.2, reconnect_max_s=0.5), RGB, SMALL_MODEL)
    try:
        frames = read_frames(source, 5, timeout=60)  # ffmpeg starting x264 on a loaded machine
    finally:
        source.close()
        end_process(server, graceful=False)
    assert len(frames) == 5, source.stats
    assert frames[-1].scale == scale and frames[-1].data.shape == (360 // scale, 640 // scale, 3)
    assert source.stats.decoder["path"] == ("jpeg" if codec == "mjpeg" else "ffmpeg")
