"""The live view (issue 45): the latest frame of each source with its served result drawn, on the agent's own
/metrics listener, opened in a real headless Chromium; nothing kept or drawn while nobody watches."""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.link.liveview import GREEN, YELLOW, Kept, LiveView, draw
from agentproc import demo_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nothing_is_kept_or_drawn_while_nobody_watches_and_keeping_is_bounded_when_someone_does() -> None:
    clock = Clock()
    view = LiveView(lambda: {}, clock=clock)
    frame = np.zeros((8, 8, 3), np.uint8)
    assert not view.wanted("cam")  # nobody asked: the pipeline copies nothing
    view.served(1, 1, {"type": "classes", "top": []})
    assert view.sources() == [] and view.drawn == 0
    assert view.snapshot("cam") is None  # a viewer asks: from now on frames are kept
    assert view.wanted("cam")
    view.keep(7, "cam", frame, 1, True)
    assert not view.wanted("cam")  # at most KEEP_PER_S copies a second
    view.served(7, 1, {"type": "classes", "top": [{"label": "zero", "score": 0.9}]})
    first = view.snapshot("cam")
    assert first is not None and view.snapshot("cam") == first and view.drawn == 1  # drawn once per frame
    clock.t += 60  # nobody asked for a minute: nothing is kept again
    assert not view.wanted("cam")


def test_boxes_keypoints_masks_and_words_are_drawn_where_the_result_says() -> None:
    pixels = np.zeros((400, 400, 3), np.uint8)
    result = {"type": "boxes", "boxes": [{"box": [100.0, 100.0, 300.0, 300.0], "score": 0.9, "label": "cat",
                                          "keypoints": [[200.0, 200.0, 1.0]]}]}
    img = draw(Kept("cam", pixels, 1, True, 1, result, 0.0))
    assert tuple(img[300, 200]) == GREEN and tuple(img[200, 100]) == GREEN  # the box's edges
    assert tuple(img[200, 200]) == YELLOW  # the keypoint
    assert not img[250:290, 250:290].any()  # inside, away from the marks: the frame as it was
    half = draw(Kept("cam", pixels, 2, True, 1, result, 0.0))  # decoded at 1/2: results are in camera pixels
    assert tuple(half[150, 100]) == GREEN and not half[300, 200].any()
    # a mask as RLE (column-major, background first) over the left half of a 4x4 frame, tinted
    mask = draw(Kept("cam", pixels, 1, True, 1, {"type": "masks", "size": [4, 4],
                                                   "rle": {"size": [4, 4], "counts": [0, 8, 8]}}, 0.0))
    assert mask[200, 50].any() and not mask[200, 350].any()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _watch(agent, port: int, tmp_path: Path) -> tuple[np.ndarray, str]:
    """Look at the live view as a person does: the page until it shows the source, its drawn snapshot, then the
    page in headless Chromium (DOM and screenshot). Returns the snapshot and the browser's DOM."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: scripts/test.sh installs it (apt-get install chromium)")
    base = f"http://127.0.0.1:{port}"
    agent.wait_event("boot.ready", timeout=120)
    first = _get(f"{base}/live")  # the first look: from now on frames are kept
    assert first[0] == 200 and b"id='no-frames'" in first[1]  # nothing was kept before anyone looked
    agent.wait(lambda: b"<img id='live-0'" in _get(f"{base}/live")[1], timeout=60, what="the source on the page")
    name = _get(f"{base}/live")[1].split(b"/live/snapshot/")[1].split(b"'")[0].decode()
    snap = f"{base}/live/snapshot/{name}"
    agent.wait(lambda: _get(snap)[0] == 200, timeout=60, what="a drawn snapshot")
    img = cv2.imdecode(np.frombuffer(_get(snap)[1], np.uint8), cv2.IMREAD_COLOR)
    shot = tmp_path / "live.png"
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--no-first-run", "--window-size=1000,600",
                          f"--screenshot={shot}", "--dump-dom", f"{base}/live"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert "id=\"live-0\"" in dom and "id=\"verdict\"" in dom and ">PASS<" in dom
    shown = cv2.imread(str(shot))
    assert (np.abs(shown.astype(int) - shown[590, 990].astype(int)).sum(axis=2) > 60).sum() > 20_000  # the frame
    assert _get(f"{base}/metrics")[0] == 200  # /metrics still served by the same listener
    with urllib.request.urlopen(f"{base}/live/stream/{name.removesuffix('.jpg')}.mjpg", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("multipart/x-mixed-replace")
        head = r.read(200)  # the first part's headers and the start of its JPEG; then the viewer leaves
        assert head.startswith(b"--edgeagentframe\r\nContent-Type: image/jpeg") and b"\xff\xd8" in head
    print(f"screenshot: {shot}")
    return img, dom


def test_the_live_page_shows_the_demo_frame_with_its_result_drawn_in_chromium(tmp_path: Path, agent_process) -> None:
    port = _free_port()
    agent = agent_process(demo_config(tmp_path, metrics={"listen": f"127.0.0.1:{port}", "live_view": True},
                                      output={"stdout": False, "health_interval_s": 0.5})).start()
    try:
        img, dom = _watch(agent, port, tmp_path)
    finally:
        agent.stop()
    assert img.shape == (320, 320, 3)  # the 160 px demo frame, enlarged for legible words
    assert (img[5:60, 5:150] > 230).all(axis=2).sum() > 50  # the top classes written in white, top left
    assert "digits-classifier v1" in dom  # what serves, beside the picture


def test_the_live_page_draws_a_detectors_boxes_and_keypoints_where_it_served_them(tmp_path: Path,
                                                                                 agent_process) -> None:
    """A stand-in detector (a constant head and a boxes + keypoints post graph, tests/stage_graphs.py) serves
    box [5, 10, 15, 20] and keypoints (7.5, 12.5), (10, 15) on 40x40 frames: drawn there, enlarged 8 times."""
    from agent.bundle.create import CreateOptions, create_bundle
    from stage_graphs import boxes_keypoints_post, constant_head_model

    import yaml

    head = np.array([[[4, 8, 12, 16, 0.9, 6, 10, 8, 12]]], np.float32)  # input pixels (32x32 of a 40x40 frame)
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(4):  # grey frames: nothing in them looks like the marks drawn
        cv2.imwrite(str(frames / f"{i:03d}.png"), np.full((40, 40, 3), 90 + 10 * i, np.uint8))
    spec = {"name": "det", "version": 1, "task": "boxes",
            "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
            "preprocess": {"resize": {"width": 32, "height": 32, "mode": "stretch"}, "scale": 1 / 255,
                           "layout": "nchw", "dtype": "float32"},
            "postprocess": {"result": {"kind": "boxes", "boxes": "det_boxes", "scores": "det_scores",
                                       "keypoints": "det_kps"}}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    bundle = create_bundle(CreateOptions(model=constant_head_model(tmp_path / "m.onnx", head),
                                         spec=tmp_path / "spec.yaml", calibration=frames, golden=frames,
                                         out=tmp_path / "bundle", int8=False,
                                         post_graph=boxes_keypoints_post(tmp_path / "post.onnx", "output", 1, 2),
                                         allow_unproven_decoder=True))  # a constant head: no package answers
    port = _free_port()
    agent = agent_process(demo_config(tmp_path, bundle=str(bundle),
                                      source={"path": str(frames), "loop": True, "max_fps": 50},
                                      metrics={"listen": f"127.0.0.1:{port}", "live_view": True},
                                      output={"stdout": False, "health_interval_s": 0.5})).start()
    try:
        img, dom = _watch(agent, port, tmp_path)
    finally:
        agent.stop()
    assert img.shape == (320, 320, 3)
    green = (img[:, :, 1] > 150) & (img[:, :, 0] < 120) & (img[:, :, 2] < 120)
    assert green[157:164, 60:100].any(axis=0).all() and green[100:140, 117:124].any(axis=1).all()  # bottom, right
    assert not green[100:140, 60:100].any()  # inside it: the frame
    yellow = (img[:, :, 1] > 150) & (img[:, :, 2] > 150) & (img[:, :, 0] < 120)
    assert yellow[97:103, 57:63].any() and yellow[117:123, 77:83].any()  # the keypoints at 8 x (7.5, 12.5), (10, 15)
    assert "det v1" in dom


def test_live_view_without_a_listener_is_refused_by_config_check(tmp_path: Path) -> None:
    from agent.config import Config, MetricsConfig
    from agent.service.preflight import Findings, _check_metrics

    f = Findings()
    _check_metrics(Config(metrics=MetricsConfig(live_view=True)), f)
    assert f.problems and f.problems[0].startswith("key metrics.live_view: ")


def test_mjpeg_streams_are_bounded_and_give_their_place_back_when_closed() -> None:
    from agent.link import liveview

    clock = Clock()
    view = LiveView(lambda: {}, clock=clock)
    view.sleep = lambda s: setattr(clock, "t", clock.t + s)  # the stream's pacing, on the test's clock
    view.snapshot("cam")  # watched
    view.keep(1, "cam", np.zeros((8, 8, 3), np.uint8), 1, True)
    view.served(1, 1, {"type": "classes", "top": [{"label": "a", "score": 1.0}]})
    app = view.wsgi(lambda env, start: [b"metrics"])
    said: list[str] = []
    opened = [app({"PATH_INFO": "/live/stream/cam.mjpg"}, lambda status, headers: said.append(status))
              for _ in range(liveview.MAX_STREAMS + 1)]
    assert said == ["200 OK"] * liveview.MAX_STREAMS + ["503 Service Unavailable"]
    part = next(iter(opened[0]))
    assert part.startswith(b"--edgeagentframe\r\nContent-Type: image/jpeg") and b"\xff\xd8" in part  # a JPEG
    for body in opened[:-1]:
        body.close()  # the viewers left (one before its first part)
    assert app({"PATH_INFO": "/live/stream/cam.mjpg"}, lambda status, headers: said.append(status)) is not None
    assert said[-1] == "200 OK"  # their places are free again
    assert b"".join(app({"PATH_INFO": "/metrics"}, lambda s, h: None)) == b"metrics"  # the rest: /metrics


def _ask_snapshot(port: int, prefix: str, payload: bytes, collector) -> dict:
    """cmd/snapshot sent once the collector's subscriptions hold; its reply (the next one on the reply topic)."""
    import json

    before = len(collector.on(prefix + "cmd/snapshot/reply"))
    collector.c.publish(prefix + "cmd/snapshot", payload, qos=1).wait_for_publish(10)
    assert collector.wait(lambda: len(collector.on(prefix + "cmd/snapshot/reply")) > before, 60), "no reply"
    return json.loads(collector.on(prefix + "cmd/snapshot/reply")[before].payload)


@pytest.mark.skipif(not Path(__import__("brokers").MOSQUITTO).exists(), reason="mosquitto not installed")
def test_cmd_snapshot_publishes_the_served_frame_with_its_result_drawn_as_jpeg_over_mqtt(tmp_path: Path,
                                                                                          agent_process) -> None:
    """Frigate's snapshot topics: on cmd/snapshot the agent (no HTTP listener, no live view configured) publishes the
    next frame it serves with the result drawn on <prefix>snapshot/<source> and says where in its reply; an unknown
    source, or one that serves nothing in the time asked (paused), is a clear error naming it."""
    from brokers import Broker, Collector

    broker = Broker(tmp_path / "broker").start()
    prefix = "edge/dev-snap/"
    col = Collector(broker.port, [prefix + "cmd/snapshot/reply", prefix + "snapshot/#", prefix + "health"])
    agent = agent_process(demo_config(tmp_path, port=broker.port, device_id="dev-snap", source={"max_fps": 40},
                                      output={"stdout": False, "health_interval_s": 0.5})).start()
    try:
        assert col.wait(lambda: col.connects >= 1, 30)
        assert col.wait(lambda: any(__import__("json").loads(m.payload).get("serving")
                                    for m in col.on(prefix + "health")), 120), "never served"
        bad = _ask_snapshot(broker.port, prefix, b'{"source": "nope"}', col)
        assert bad["ok"] is False and "unknown source 'nope'" in bad["error"] and "(sources: " in bad["error"]
        source = bad["error"].split("(sources: ")[1].rstrip(")").split(", ")[0]

        r = _ask_snapshot(broker.port, prefix, b'{"id": "s1"}', col)
        assert r["ok"] is True and r["id"] == "s1", r
        (shot,) = r["snapshots"]
        assert shot["source"] == source and shot["topic"] == prefix + "snapshot/" + source
        (msg,) = col.on(shot["topic"])
        assert not msg.retain and len(msg.payload) == shot["bytes"] <= 1 << 20
        img = cv2.imdecode(np.frombuffer(msg.payload, np.uint8), cv2.IMREAD_COLOR)
        assert img is not None and img.shape == (shot["height"], shot["width"], 3) == (320, 320, 3)  # 160 px, x2

        # which demo frame it is: the raw frame, enlarged as drawn, nearest away from the words (bottom half)
        raws = [cv2.resize(cv2.imread(str(p)), (320, 320), interpolation=cv2.INTER_NEAREST)
                for p in sorted((Path(__file__).resolve().parents[2] / "models/demo-frames/digits").glob("*.png"))]
        diff = [np.abs(raw.astype(int) - img.astype(int)) for raw in raws]
        best = min(diff, key=lambda d: float(d[200:].mean()))
        assert best[200:].mean() < 12  # the served frame itself (JPEG noise only) below the words
        # and the label drawn top left, where it differs: pixels far from the raw frame there, against the same
        # area below the words (JPEG noise only); a pixel count, not a mean, so a short label passes as a long one
        label = int((best[5:60, 5:150].max(axis=2) > 80).sum())
        below = int((best[200:255, 5:150].max(axis=2) > 80).sum())
        assert label > 200 and label > 10 * below, (label, below)
        assert (img[5:60, 5:150] > 230).all(axis=2).sum() > 50  # in white

        col.c.publish(prefix + "cmd/pause", b"{}", qos=1).wait_for_publish(10)
        assert col.wait(lambda: __import__("json").loads(col.on(prefix + "health")[-1].payload).get("paused"), 30)
        idle = _ask_snapshot(broker.port, prefix, b'{"timeout_s": 1}', col)
        assert idle["ok"] is False and idle["snapshots"] == []
        assert f"source {source!r}: no frame served in 1 s (serving is paused: send resume)" in idle["error"]
    finally:
        agent.stop()
        col.close()
        broker.stop()


def test_a_snapshot_jpeg_is_bounded_lower_quality_then_halved_until_it_fits() -> None:
    from agent.link.liveview import bounded_jpeg

    noise = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), np.uint8)  # the worst case for JPEG
    small = bounded_jpeg(noise, max_bytes=100_000)
    img = cv2.imdecode(np.frombuffer(small, np.uint8), cv2.IMREAD_COLOR)
    assert len(small) <= 100_000 and img.shape[0] < 1024  # it did not fit at full size: halved
    whole = bounded_jpeg(np.zeros((64, 64, 3), np.uint8))
    assert cv2.imdecode(np.frombuffer(whole, np.uint8), cv2.IMREAD_COLOR).shape == (64, 64, 3)  # fits: as it is
    with pytest.raises(ValueError, match="does not fit in 10 bytes"):
        bounded_jpeg(noise, max_bytes=10)


@pytest.mark.skipif(not Path(__import__("brokers").MOSQUITTO).exists(), reason="mosquitto not installed")
def test_cmd_snapshot_without_a_source_publishes_one_jpeg_per_listed_source(tmp_path: Path, agent_process) -> None:
    from brokers import Broker, Collector

    frames = str(Path(__file__).resolve().parents[2] / "models/demo-frames/digits")
    broker = Broker(tmp_path / "broker").start()
    prefix = "edge/dev-snaps/"
    col = Collector(broker.port, [prefix + "cmd/snapshot/reply", prefix + "snapshot/#", prefix + "health"])
    agent = agent_process(demo_config(
        tmp_path, port=broker.port, device_id="dev-snaps", output={"stdout": False, "health_interval_s": 0.5},
        sources=[{"name": "door", "type": "folder", "path": frames, "loop": True, "max_fps": 20},
                 {"name": "yard", "type": "folder", "path": frames, "loop": True, "max_fps": 20}])).start()
    try:
        assert col.wait(lambda: col.connects >= 1, 30)
        assert col.wait(lambda: any(__import__("json").loads(m.payload).get("serving")
                                    for m in col.on(prefix + "health")), 120), "never served"
        r = _ask_snapshot(broker.port, prefix, b"{}", col)
        assert r["ok"] is True, r
        assert sorted(s["topic"] for s in r["snapshots"]) == [prefix + "snapshot/door", prefix + "snapshot/yard"]
        for s in r["snapshots"]:
            (msg,) = col.on(s["topic"])
            img = cv2.imdecode(np.frombuffer(msg.payload, np.uint8), cv2.IMREAD_COLOR)
            assert img.shape == (s["height"], s["width"], 3)
    finally:
        agent.stop()
        col.close()
        broker.stop()
