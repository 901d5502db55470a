"""Shared fixtures: a tiny real bundle built once per run with `bundle create`, and the demo bundle."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from full_disk import small_disk  # noqa: F401 - a real full disk (tests/full_disk.py) for every folder

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "digits-classifier"

TINY_SPEC = {
    "name": "tiny-classifier",
    "version": 1,
    "label": "0.1.0",
    "task": "classification",
    "frame": {"kind": "image", "height": 40, "width": 40, "channels": 3, "color": "rgb"},
    "preprocess": {
        "resize": {"width": 32, "height": 32, "mode": "stretch", "interpolation": "linear"},
        "color": "rgb", "scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
        "layout": "nchw", "dtype": "float32",
    },
    "postprocess": {"type": "classification", "output": "logits", "top_k": 2},
}


def write_sample_sets(d: Path, seed: int = 1) -> dict[str, Path]:
    from agent.testing import structured_frames

    d.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(d / "calib.npz", raw=structured_frames(48, 40, seed))
    np.savez_compressed(d / "golden.npz", raw=structured_frames(8, 40, seed + 1))
    np.savez_compressed(d / "heldout.npz", raw=structured_frames(64, 40, seed + 2))
    (d / "spec.yaml").write_text(yaml.safe_dump(TINY_SPEC))
    (d / "labels.txt").write_text("a\nb\nc\nd\n")
    return {"calibration": d / "calib.npz", "golden": d / "golden.npz", "heldout": d / "heldout.npz",
            "spec": d / "spec.yaml", "labels": d / "labels.txt"}


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from agent.testing import make_tiny_classifier

    d = tmp_path_factory.mktemp("tiny-inputs")
    sets = write_sample_sets(d)
    sets["model"] = make_tiny_classifier(d / "tiny.onnx")
    return sets


@pytest.fixture(scope="session")
def tiny_bundle_master(tiny_inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle

    out = tmp_path_factory.mktemp("tiny-bundle") / "tiny"
    return create_bundle(CreateOptions(out=out, min_agreement=0.5, **tiny_inputs))


@pytest.fixture
def tiny_bundle(tiny_bundle_master: Path, tmp_path: Path) -> Path:
    """A private copy each test may damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_master, dst)
    return dst


TINY_SENSOR_SPEC = {
    "name": "tiny-sensor",
    "version": 1,
    "label": "0.1.0",
    "task": "classification",
    "frame": {"kind": "sensor", "window": 64, "channels": 3, "dtype": "float32"},
    "preprocess": {"scale": 1.0, "mean": [0.0], "std": [2.0], "layout": "ncw", "dtype": "float32"},
    "postprocess": {"type": "classification", "output": "scores", "top_k": 1},
}


@pytest.fixture(scope="session")
def tiny_sensor_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.bundle.create import CreateOptions, create_bundle
    from agent.testing import make_tiny_sensor_model

    d = tmp_path_factory.mktemp("tiny-sensor")
    rng = np.random.default_rng(5)
    t = np.arange(64, dtype=np.float32)
    def windows(n: int) -> np.ndarray:
        f = rng.uniform(0.05, 0.4, (n, 1, 3))
        return (np.sin(t[None, :, None] * f) + rng.normal(0, 0.2, (n, 64, 3))).astype(np.float32)
    np.savez(d / "calib.npz", raw=windows(32))
    np.savez(d / "golden.npz", raw=windows(6))
    (d / "spec.yaml").write_text(yaml.safe_dump(TINY_SENSOR_SPEC))
    return create_bundle(CreateOptions(
        model=make_tiny_sensor_model(d / "s.onnx"), spec=d / "spec.yaml", calibration=d / "calib.npz",
        golden=d / "golden.npz", out=d / "bundle", min_agreement=0.5, keep_low_quality=True,
    ))


@pytest.fixture
def agent_process(tmp_path: Path):
    """A factory of real agent processes (tests/agentproc.py), each stopped at the end of the test.

    `agent_process(config=None, name="agent", env=None, args=(), log_args=("--log-json",))`: config
    defaults to the demo config in this test's tmp_path; call `.start()` (or `.run()`) on what it returns.
    Each process of a test gets its own name (agent, agent2, ...: a second boot keeps its own log)
    unless `name` is given."""
    from agentproc import AgentProcess

    made: list[AgentProcess] = []

    def make(config=None, name: str | None = None, env=None, args=(), log_args=("--log-json",)) -> AgentProcess:
        name = name or ("agent" if not made else f"agent{len(made) + 1}")
        a = AgentProcess(tmp_path, config, env=env, args=args, name=name, log_args=log_args)
        made.append(a)
        return a

    yield make
    for a in made:
        a.stop()


@pytest.fixture
def demo_bundle() -> Path:
    if not (DEMO / "bundle.yaml").exists():
        pytest.fail(f"{DEMO} is missing: run scripts/build_demo_classifier.py")
    return DEMO


@pytest.fixture(autouse=True)
def _structlog_config_restored():
    """A test that runs the CLI's main() in-process configures structlog for its own run (a level, a
    stderr that pytest closes after the test): later tests in that worker then logged to a closed file and
    captured no event under the level. Every test leaves the configuration as it found it."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
