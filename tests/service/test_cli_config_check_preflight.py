"""`config check` refuses what `run` would refuse before serving (issue 18): a "video" that is not a video,
metrics.listen without prometheus_client, a state directory that cannot be written, a folder with no images;
each in one line naming the key, the path and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"


def _check(tmp_path: Path, env: dict | None = None, **cfg: object) -> subprocess.CompletedProcess:
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO),
                                 "source": {"type": "folder", "path": str(FRAMES)}, **cfg}))
    return subprocess.run([sys.executable, "-m", "agent", "config", "check", str(p)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-agent: ") and "Traceback" not in err, err
    return lines[0]


def test_a_good_config_still_passes(tmp_path: Path) -> None:
    out = _check(tmp_path)
    assert out.returncode == 0, out.stderr


def test_a_video_that_is_not_a_video_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "clip.mp4"
    fake.write_bytes(b"\x00not a video" * 100)
    out = _check(tmp_path, source={"type": "video", "path": str(fake)})
    assert out.returncode == 1
    assert f"key source.path: {fake} is not a video FFmpeg can open" in _one_line(out.stderr)


def test_a_real_video_passes(tmp_path: Path) -> None:
    import cv2
    import numpy as np

    clip = tmp_path / "clip.avi"
    w = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 5, (28, 28))
    for i in range(3):
        w.write(np.full((28, 28, 3), 40 * i, np.uint8))
    w.release()
    out = _check(tmp_path, source={"type": "video", "path": str(clip)})
    assert out.returncode == 0, out.stderr


def test_a_folder_without_images_is_refused_as_run_would(tmp_path: Path) -> None:
    empty = tmp_path / "frames"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    out = _check(tmp_path, source={"type": "folder", "path": str(empty)})
    assert out.returncode == 1 and f"{empty} holds no images" in _one_line(out.stderr)


def test_metrics_without_prometheus_client_is_refused_with_the_checkout_install_hint(tmp_path: Path) -> None:
    # a real import failure: a package of that name that raises ImportError comes first on the path
    shadow = tmp_path / "shadow" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('prometheus_client is not installed (test shadow)')\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}"}
    out = _check(tmp_path, env=env, metrics={"listen": "127.0.0.1:9108"})
    assert out.returncode == 1
    line = _one_line(out.stderr)
    assert "key metrics.listen: set, but prometheus_client is not installed" in line
    assert "pip install '.[metrics]'" in line and "edge-agent[" not in line


def test_a_state_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = _check(tmp_path, state_dir=str(blocker / "state"))
    assert out.returncode == 1
    assert f"key state_dir: {blocker / 'state'} cannot be created: {blocker} is not a directory" in _one_line(out.stderr)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory modes")
def test_a_read_only_state_dir_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        out = _check(tmp_path, state_dir=str(ro))
    finally:
        ro.chmod(0o700)
    assert out.returncode == 1 and f"key state_dir: {ro} is not writable by this user" in _one_line(out.stderr)


def test_an_unreadable_mqtt_password_file_is_refused(tmp_path: Path) -> None:
    out = _check(tmp_path, mqtt={"enabled": True, "password_file": str(tmp_path / "nope")})
    assert out.returncode == 1 and "key mqtt.password_file: cannot read" in _one_line(out.stderr)


def _check_doc(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess:
    p = tmp_path / "agent.yaml"
    p.write_text(yaml.safe_dump(doc))
    return subprocess.run([sys.executable, "-m", "agent", "config", "check", str(p)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs sysfs")
def test_a_state_dir_under_sysfs_is_refused_although_access_says_writable(tmp_path: Path) -> None:
    """Fault: the check trusted os.access on the parent (root: yes for /sys); mkdir there fails. Now it creates."""
    out = _check(tmp_path, state_dir="/sys/edge-agent-check")
    assert out.returncode == 1, out.stderr
    assert "key state_dir: /sys/edge-agent-check cannot be created: " in _one_line(out.stderr)
    assert not Path("/sys/edge-agent-check").exists()


def test_no_bundle_with_no_way_to_receive_one_is_refused(tmp_path: Path) -> None:
    base = {"state_dir": str(tmp_path / "state"), "source": {"type": "folder", "path": str(FRAMES)}}
    out = _check_doc(tmp_path, base)
    assert out.returncode == 1
    assert "key bundle: not set, and nothing could deliver one" in _one_line(out.stderr)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    ok = _check_doc(tmp_path, {**base, "updates": {"enabled": True, "inbox": str(inbox), "allow_unsigned": True}})
    assert ok.returncode == 0, ok.stderr  # an inbox can deliver one: "not serving until one is pushed", a note


def test_a_provider_pin_this_build_lacks_without_cpu_fallback_is_refused(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    out = _check(tmp_path, selection={"provider": "CUDAExecutionProvider", "allow_cpu_fallback": False})
    assert out.returncode == 1
    line = _one_line(out.stderr)
    assert "key selection.provider: CUDAExecutionProvider is not in this onnxruntime build" in line
    assert "allow_cpu_fallback: true" in line
    assert _check(tmp_path, selection={"provider": "CUDAExecutionProvider"}).returncode == 0  # falls back: serves


def test_a_camera_node_that_is_absent_is_refused(tmp_path: Path) -> None:
    node = "/dev/video97"
    if Path(node).exists():
        pytest.skip(f"{node} exists here")
    out = _check(tmp_path, source={"type": "camera", "device": node})
    assert out.returncode == 1
    assert f"key source.device: {node} does not exist" in _one_line(out.stderr)
