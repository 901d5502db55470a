"""Cold start (issue 24 item 4): the boot proof does not prove reduced decode scales that no configured source
can choose, and serves the same scale it served when every scale was proven."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.bundle.load import load_bundle
from agent.config import Config, SourceConfig
from agent.proof.selftest import (
    SourceScaleLimit,
    check_reduced_decode,
    choosable_scale,
    decode_paths,
    options_from_config,
    run_selftest,
    source_scale_limits,
)
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate
from agent.vocabulary.jpeg import decode_scale

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def _video(path: Path, height: int, width: int) -> Path:
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (width, height))
    assert out.isOpened()
    for i in range(3):
        out.write(np.full((height, width, 3), 40 * i, np.uint8))
    out.release()
    return path


def test_a_720p_video_proves_scales_up_to_what_it_can_choose_and_serves_the_same_scale(tmp_path: Path) -> None:
    video = _video(tmp_path / "cam-720p.avi", 720, 1280)
    cfg = Config(state_dir=tmp_path / "state", bundle=DEMO, source=SourceConfig(type="video", path=video))
    bundle = load_bundle(DEMO)
    resize = bundle.manifest.preprocess.resize
    opts = options_from_config(cfg)
    assert opts.source_limits == (SourceScaleLimit(None, (720, 1280)),)
    assert choosable_scale(opts.source_limits, resize) == 4  # 720 / 8 = 90 rows: under the model's 128

    report = run_selftest(bundle, tmp_path / "state", opts).to_dict()
    dec = report["decode"]
    assert report["passed"] and [e["scale"] for e in dec["scales"]] == [2, 4], dec
    assert dec["max_scale"] == 4 and dec["bound"] == 4 and "cannot be chosen" in dec["reason"]

    # every scale proven on the same candidate: 1/8 passes too, and the 720p frame is served at the same scale
    sel = report["selected"]
    unbounded = check_reduced_decode(bundle, Candidate(CPU, sel["variant"], sel["precision"]), SessionSettings(),
                                     bundle.golden())
    assert unbounded["max_scale"] == 8 and unbounded["bound"] == 8
    served = decode_scale("auto", resize, 720, 1280, limit=dec["max_scale"])
    assert served == decode_scale("auto", resize, 720, 1280, limit=unbounded["max_scale"]) == 4


def test_a_cached_verdict_proves_the_scales_a_new_source_can_choose(tmp_path: Path) -> None:
    video = _video(tmp_path / "cam-720p.avi", 720, 1280)
    bundle = load_bundle(DEMO)
    state = tmp_path / "state"
    first = run_selftest(bundle, state, options_from_config(
        Config(state_dir=state, source=SourceConfig(type="video", path=video)))).to_dict()
    assert not first["cached"] and first["decode"]["max_scale"] == 4

    camera = Config(state_dir=state, source=SourceConfig(type="stream", url="rtsp://127.0.0.1:1/cam"))
    again = run_selftest(bundle, state, options_from_config(camera)).to_dict()
    assert again["cached"], "the verdict itself is reused"
    assert again["decode"]["bound"] == 8 and again["decode"]["max_scale"] == 8, again["decode"]
    assert [e["scale"] for e in again["decode"]["scales"]] == [2, 4, 8]

    same = run_selftest(bundle, state, options_from_config(
        Config(state_dir=state, source=SourceConfig(type="video", path=video)))).to_dict()
    assert same["cached"] and same["decode"] == first["decode"], "a check bounded at least as high is reused"


def test_only_what_is_known_before_opening_bounds_the_scales(tmp_path: Path) -> None:
    resize = load_bundle(DEMO).manifest.preprocess.resize
    small = _video(tmp_path / "small.avi", 200, 200)  # 200 / 2 = 100 rows: no scale fits a 128 x 128 model
    unreadable = tmp_path / "not-a-video.mp4"
    unreadable.write_bytes(b"no header here")
    cases = {
        SourceConfig(type="video", path=small): 1,
        SourceConfig(type="video", path=_video(tmp_path / "fhd.avi", 1080, 1920)): 8,
        SourceConfig(type="video", path=unreadable): 8,  # nothing known: every scale may be chosen
        SourceConfig(type="video", path=tmp_path / "missing.mp4"): 8,
        SourceConfig(type="stream", url="rtsp://127.0.0.1:1/cam"): 8,
        SourceConfig(type="stream", url="rtsp://127.0.0.1:1/cam", decode_scale=2): 2,
    }
    for src, want in cases.items():
        assert choosable_scale(source_scale_limits(Config(source=src)), resize) == want, src
    # many sources: the largest any of them can choose
    both = Config(sources=(SourceConfig(type="video", path=small, name="a"),
                           SourceConfig(type="stream", url="rtsp://127.0.0.1:1/cam", decode_scale=4, name="b")))
    assert choosable_scale(source_scale_limits(both), resize) == 4
    assert choosable_scale((), resize) == 8


def test_a_reduced_path_no_configured_source_serves_through_is_not_proven(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: a shortcut that cannot pay off for the configured source is skipped. A folder of JPEGs is served
    through JPEG's DCT scaling only and an H.264/MPEG-4 file through the decoder's planes only: the other path's
    half of the check bought nothing. A camera or a stream, unknown before it opens, proves both."""
    from agent.proof import reduced_decode as selftest_mod  # the reduced-decode check makes its frames there

    jpegs = tmp_path / "jpegs"
    jpegs.mkdir()
    cv2.imwrite(str(jpegs / "a.jpg"), np.full((480, 640, 3), 90, np.uint8))
    mp4 = tmp_path / "cam.mp4"
    out = cv2.VideoWriter(str(mp4), cv2.VideoWriter_fourcc(*"mp4v"), 10, (640, 480))
    assert out.isOpened()
    for i in range(3):
        out.write(np.full((480, 640, 3), 40 * i, np.uint8))
    out.release()
    folder = options_from_config(Config(state_dir=tmp_path / "s", source=SourceConfig(path=jpegs)))
    assert decode_paths(folder.source_limits) == ("jpeg",)
    video = options_from_config(Config(state_dir=tmp_path / "s", source=SourceConfig(type="video", path=mp4)))
    assert decode_paths(video.source_limits) == ("video",)
    both = Config(state_dir=tmp_path / "s", sources=[SourceConfig(name="f", path=jpegs),
                                                     SourceConfig(name="cam", type="stream", url="rtsp://127.0.0.1/x")])
    assert decode_paths(options_from_config(both).source_limits) == ("jpeg", "video")

    planes: list[int] = []
    real = selftest_mod.camera_sized_reduced_yuv
    monkeypatch.setattr(selftest_mod, "camera_sized_reduced_yuv",
                        lambda raw, s, color: (planes.append(s), real(raw, s, color))[1])
    dec = run_selftest(load_bundle(DEMO), tmp_path / "state", folder).to_dict()["decode"]
    assert dec["paths"] == ["jpeg"] and dec["max_scale"] > 1, dec
    assert all(set(e["paths"]) == {"jpeg"} for e in dec["scales"]), dec["scales"]
    assert planes == [], "the video planes were proven for a folder of JPEGs"
    camera = Config(state_dir=tmp_path / "s", source=SourceConfig(type="stream", url="rtsp://127.0.0.1:1/cam"))
    again = run_selftest(load_bundle(DEMO), tmp_path / "state", options_from_config(camera)).to_dict()
    assert again["cached"] and again["decode"]["paths"] == ["jpeg", "video"] and planes, \
        "a cached verdict whose check skipped a path today's sources need proves it"
