"""The reduced decode is proven on both paths that serve it: JPEG scaled in the DCT and the H.264/H.265
decoder's planes averaged down before colour conversion (issue 24 item 2: the video path was served at
the scale only the JPEG check had proven)."""

from __future__ import annotations

from pathlib import Path

from agent.bundle.load import load_bundle
from agent.proof.selftest import check_reduced_decode
from agent.proof.terms import CPU, SessionSettings
from agent.proof.verdict import Candidate

DEMO = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def test_each_proven_scale_reproduced_the_full_path_on_the_jpeg_and_the_video_planes() -> None:
    bundle = load_bundle(DEMO)
    fp32 = bundle.manifest.variant("fp32")
    report = check_reduced_decode(bundle, Candidate(CPU, fp32.name, fp32.precision), SessionSettings(),
                                  bundle.golden())
    assert report["scales"], report
    for entry in report["scales"]:
        assert set(entry["paths"]) == {"jpeg", "video"} or not entry["passed"], entry
        if entry["passed"]:
            assert all(p["passed"] for p in entry["paths"].values())
            assert entry["paths"]["video"]["reproduction"]["passed"] is True
    passed = [e["scale"] for e in report["scales"] if e["passed"]]
    assert report["max_scale"] == (max(passed) if passed else 1)


def test_a_config_whose_sources_cannot_decode_reduced_skips_the_scales_and_says_why(tmp_path: Path) -> None:
    import cv2
    import numpy as np

    from agent.config import Config, SourceConfig
    from agent.proof.selftest import no_reduced_decode

    pngs, jpgs = tmp_path / "png", tmp_path / "jpg"
    pngs.mkdir()
    jpgs.mkdir()
    cv2.imwrite(str(pngs / "a.png"), np.zeros((8, 8, 3), np.uint8))
    cv2.imwrite(str(jpgs / "a.jpg"), np.zeros((8, 8, 3), np.uint8))
    assert "no configured source" in (no_reduced_decode(Config(source=SourceConfig(path=pngs))) or "")
    assert no_reduced_decode(Config(source=SourceConfig(path=jpgs))) is None  # JPEGs may decode reduced
    assert no_reduced_decode(Config(source=SourceConfig(type="stream", url="rtsp://127.0.0.1/x"))) is None
    assert no_reduced_decode(Config(source=SourceConfig(type="stream", url="rtsp://x", decode_scale=1))) is not None
    assert no_reduced_decode(Config(source=SourceConfig())) is None  # a folder not named yet: proven
