#!/usr/bin/env python3
"""Fetch pipecat-ai's Smart Turn v3.2 (an already-quantised end-of-turn classifier over a Whisper log-mel
of the last 8 s) and the package's own numpy feature code, for tests/bundle/test_sensor_frontend.py.

`pip download pipecat-ai==1.14.0 --no-deps` (BSD-2-Clause, checked in the wheel's METADATA), then extract
the model and `_whisper_features.py` into $EDGE_AGENT_CACHE/real-models/smart-turn/ with pinned hashes.
Nothing of pipecat is installed or imported by the agent.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

PACKAGE, VERSION, LICENCE = "pipecat-ai", "1.14.0", "BSD-2-Clause"
FILES = {  # member -> (name in the cache, sha256)
    "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx":
        ("model.onnx", "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"),
    "pipecat/audio/turn/smart_turn/_whisper_features.py":
        ("whisper_features.py", "139b047d10dee42ad5b4894489012e515a882d8f5e2bffe8ad27b30728fc9968"),
}
OUT = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent")) / "real-models" / "smart-turn"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    wheels = OUT / "wheel"
    found = sorted(wheels.glob(f"pipecat_ai-{VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", str(wheels), f"{PACKAGE}=={VERSION}"], check=True)
        found = sorted(wheels.glob(f"pipecat_ai-{VERSION}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        licence = Parser().parsestr(meta).get("License-Expression")
        if licence != LICENCE:
            raise SystemExit(f"{found[0].name}: licence {licence!r}, pinned {LICENCE!r}: review it first")
        for n in z.namelist():
            if n.endswith("dist-info/licenses/LICENSE"):
                (OUT / "LICENSE").write_bytes(z.read(n))
        for member, (name, digest) in FILES.items():
            data = z.read(member)
            if hashlib.sha256(data).hexdigest() != digest:
                raise SystemExit(f"{member}: sha256 {hashlib.sha256(data).hexdigest()}, pinned {digest}")
            (OUT / name).write_bytes(data)
    (OUT / "source.json").write_text(json.dumps({"package": PACKAGE, "version": VERSION, "licence": LICENCE,
                                                 "files": {v[0]: v[1] for v in FILES.values()}}, indent=2) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
