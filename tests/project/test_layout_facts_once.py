"""Facts spelled once (issue 18): one image-suffix list (a .webp folder serves and builds alike), one state-dir
resolver, the CPU provider's name from proof.terms, every exception class in agent/errors.py, and no test-only
code in the production decoders."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"


def test_one_image_suffix_list_and_a_webp_folder_serves_and_builds(tmp_path: Path) -> None:
    from agent.bundle import samples
    from agent.bundle.samples import load_samples
    from agent.config import SourceConfig
    from agent.serving import sources
    from agent.serving.sources import FolderSource
    from agent.vocabulary import preprocess
    from agent.vocabulary.manifest import FrameSpec

    assert samples.IMAGE_SUFFIXES is preprocess.IMAGE_SUFFIXES is sources.IMAGE_SUFFIXES
    assert ".webp" in preprocess.IMAGE_SUFFIXES
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(2):
        assert cv2.imwrite(str(frames / f"{i}.webp"), np.full((40, 40, 3), 60 * i, np.uint8))
    spec = FrameSpec(kind="image", height=40, width=40, channels=3, color="rgb")
    assert len(load_samples(frames, spec)) == 2  # bundle create reads them (was: refused, no .webp)
    src = FolderSource(SourceConfig(type="folder", path=frames), spec)
    assert src.files == sorted(frames.glob("*.webp"))


def test_one_state_dir_resolver(tmp_path: Path) -> None:
    code = ("from agent.service.daemon import demo_config; from agent.config import Config, user_state_dir; "
            "import agent.service.daemon as d; "
            "print(demo_config().state_dir == Config().state_dir == user_state_dir(), hasattr(d, 'default_state_dir'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})
    assert out.stdout.split() == ["True", "False"]


def _string_literals(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_the_cpu_provider_name_is_spelled_only_in_proof_terms() -> None:
    # agent/bundle/load.py sits below proof in the layout and may not import it: the one allowed copy
    allowed = {AGENT / "proof" / "terms.py", AGENT / "bundle" / "load.py"}
    wrong = [f"{p.relative_to(ROOT)}:{line}" for p in AGENT.rglob("*.py") if p not in allowed
             for line, s in _string_literals(p) if s == "CPUExecutionProvider"]
    assert not wrong, wrong


def test_every_exception_class_lives_in_agent_errors() -> None:
    from agent import errors

    wrong = []
    for p in AGENT.rglob("*.py"):
        if p.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if any(b.endswith(("Error", "Exception")) or b in dir(errors) and isinstance(
                        getattr(errors, b), type) and issubclass(getattr(errors, b), BaseException) for b in bases):
                    wrong.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not wrong, wrong


def test_nms_reference_is_test_code_only() -> None:
    import agent.vocabulary.decoders as d

    assert not hasattr(d, "nms_reference")
