"""Cold start (issue 24 item 4): what `edge-agent run` imports before its first result. PyAV is imported
while the boot proof runs when a source decodes through it (not after the proof, on the first frame's
path), and never for a folder source; nor are the modules only other commands and options need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits-classifier"
FRAMES = ROOT / "models" / "demo-frames" / "digits"

# Runs `edge-agent run` in this process and prints which of the watched modules were imported by the time
# the boot's outcome is applied (the proof done; the source not opened yet) and by the exit.
PROBE = """
import sys
import agent.service.served as served
from agent.service.cli import main
watched = ("av", "jsonschema", "matplotlib", "prometheus_client", "paho", "cryptography", "agent.report.page")
seen = {}
real = served.Served.apply_boot
def apply_boot(self, outcome):
    seen["proof"] = sorted(m for m in watched if m in sys.modules)
    return real(self, outcome)
served.Served.apply_boot = apply_boot
code = main(["--log-level", "error", "run", "--config", sys.argv[1], "--max-frames", "1"])
print("proof", ",".join(seen.get("proof", [])))
print("exit", ",".join(m for m in watched if m in sys.modules))
sys.exit(code)
"""


def _run(tmp_path: Path, source: dict) -> dict[str, set[str]]:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "bundle": str(DEMO), "source": source}))
    out = subprocess.run([sys.executable, "-c", PROBE, str(cfg)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in out.stdout.splitlines()
                 if line.startswith(("proof", "exit")))
    return {k: set(filter(None, v.split(","))) for k, v in lines.items()}


def test_a_folder_source_never_imports_pyav_nor_what_other_options_need(tmp_path: Path) -> None:
    seen = _run(tmp_path, {"type": "folder", "path": str(FRAMES)})
    # jsonschema validates the config and the manifest; nothing else watched belongs to this run
    assert seen["exit"] == {"jsonschema"}, seen


def test_a_video_source_has_pyav_imported_by_the_time_the_proof_returns(tmp_path: Path) -> None:
    import cv2
    import numpy as np

    video = tmp_path / "cam.avi"
    out = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (320, 240))
    for i in range(3):
        out.write(np.full((240, 320, 3), 60 * i, np.uint8))
    out.release()
    seen = _run(tmp_path, {"type": "video", "path": str(video)})
    assert "av" in seen["proof"], seen  # imported while the child proved, not on the first frame's path
    assert seen["exit"] == {"av", "jsonschema"}, seen


def test_the_command_line_is_parsed_before_any_heavy_import() -> None:
    """`edge-agent run` starts its proof child right after parsing its arguments, so the child's imports overlap
    the agent's: a parser that imports numpy (the graph recipes did, 88 ms) delays the child on every cold start."""
    code = ("import sys\nfrom agent.service.cli import build_parser\nbuild_parser().parse_args(['run'])\n"
            "print(','.join(m for m in ('numpy', 'onnxruntime', 'cv2', 'onnx', 'jsonschema', 'yaml') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    assert out == "", f"parsing the command line imported: {out}"


def test_a_config_typo_is_said_before_the_agent_imports_onnxruntime(tmp_path: Path) -> None:
    """`run` imported the whole agent (numpy, OpenCV, onnxruntime: 1.98 s here) before it read the config, so a
    typo's one-line error cost the full import time; agent.config itself pulled numpy through the proof's terms."""
    typo = tmp_path / "agent.yaml"
    typo.write_text("bundle: x\nsoruce: {type: folder}\n")
    code = ("import sys\nfrom agent.service.cli import main\n"
            f"code = main(['run', '--config', {str(typo)!r}])\n"
            "print('IMPORTED', ','.join(m for m in ('onnxruntime', 'agent.service.daemon') if m in sys.modules))\n"
            "sys.exit(code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "key soruce" in out.stderr and "did you mean 'source'" in out.stderr, out.stderr
    assert out.stdout.strip() == "IMPORTED", out.stdout
    light = subprocess.run([sys.executable, "-c", "import sys, agent.config\n"
                            "print(','.join(m for m in ('numpy', 'cv2', 'onnxruntime') if m in sys.modules))"],
                           capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert light == "", f"importing agent.config imported: {light}"
