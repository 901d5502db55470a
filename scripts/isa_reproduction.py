#!/usr/bin/env python3
"""Where the reproduction bounds come from: each variant of each bundle run on the bundled golden tensors under
several instruction sets, its worst element against the default bound (the proof's own `prove`), and the
device's preprocessing against the bundled tensors.

Instruction sets: this machine natively, x86-64 emulated by qemu-user at AVX2 (`-cpu Haswell`) and SSE4.2
(`-cpu Nehalem`), and arm64 (the tests' Debian arm64 root, tests/arm64_root.py) as a NEON-only Cortex-A72, a
Neoverse-N1 (NEON + dot product) and qemu's `max` (SVE2, i8mm, bf16). Needs root and qemu-user-static (what
scripts/test.sh installs). A benchmark of correctness, not a test: it prints a table.

Usage: scripts/isa_reproduction.py [--targets native,avx2,...] [BUNDLE ...]   (default: the shipped demos)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PROBE = r"""
import json, sys
from pathlib import Path
from agent.bundle.load import load_bundle
from agent.proof.isa import isa_line
from agent.proof.selftest import check_preprocessing, prove
from agent.proof.terms import SessionSettings
from agent.proof.verdict import Candidate
rows = []
for path in sys.argv[1:]:
    b = load_bundle(Path(path))
    golden = b.golden()
    pre = check_preprocessing(b, golden)
    for v in b.manifest.variants:
        t = prove(b, Candidate("CPUExecutionProvider", v.name, v.precision), SessionSettings(), golden, pre)
        ev = t.evidence
        tol = ev.reproduction.tolerance if ev.reproduction else None
        rows.append({"bundle": b.manifest.name, "variant": v.name, "error": ev.error,
                     "reproduction": ev.reproduction.passed if ev.reproduction else None,
                     "abs_diff": tol.abs_diff if tol else None, "bound": tol.bound if tol else None,
                     "fidelity": ev.fidelity.passed if ev.fidelity else None,
                     "pre_max_abs": pre[0].max_abs, "pre_levels": pre[0].max_levels, "pre_differing": pre[0].differing})
print("ISA " + json.dumps({"isa": isa_line(), "rows": rows}))
"""

X86 = {"native": None, "avx2": "Haswell-v4", "sse4.2": "Nehalem"}
ARM = {"arm64-a72": "cortex-a72", "arm64-n1": "neoverse-n1", "arm64-max": "max"}


def run_x86(cpu: str | None, bundles: list[Path], probe: Path) -> dict:
    cmd = [sys.executable, str(probe), *map(str, bundles)]
    if cpu is not None:
        cmd = ["qemu-x86_64-static", "-cpu", cpu, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return _parse(out)


def run_arm(cpu: str, bundles: list[Path], probe: Path, work: Path) -> dict:
    import arm64_root

    root = arm64_root.prepared()
    inside = []
    for b in bundles:
        dst = work / b.name
        if not dst.exists():
            shutil.copytree(b, dst)
        inside.append(f"/work/{b.name}")
    shutil.copy(probe, work / "probe.py")
    out = arm64_root.Arm64(root, work).run(["python3", "/work/probe.py", *inside], timeout=3600, env={"QEMU_CPU": cpu})
    return _parse(out)


def _parse(out: subprocess.CompletedProcess[str]) -> dict:
    for line in out.stdout.splitlines():
        if line.startswith("ISA "):
            return json.loads(line[4:])
    return {"isa": "?", "rows": [], "error": (out.stderr or out.stdout)[-600:]}


def _g(v: float | None, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join([*X86, *ARM]))
    ap.add_argument("bundles", nargs="*", type=Path,
                    default=[ROOT / "models" / "digits-classifier", ROOT / "models" / "vibration-classifier"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(PROBE)
        work = Path(tmp) / "work"
        work.mkdir()
        print(f"{'target':<10} {'bundle':<22} {'variant':<8} {'reproduction |a-b|':>19} {'bound':>10} {'ratio':>7} "
              f"{'fidelity':>8} {'pre max_abs':>11} {'levels':>6} {'differ':>7}  isa")
        for target in args.targets.split(","):
            doc = (run_x86(X86[target], args.bundles, probe) if target in X86
                   else run_arm(ARM[target], args.bundles, probe, work))
            if X86.get(target):  # qemu-x86_64 answers CPUID as the model, but /proc/cpuinfo is still the host's
                doc["isa"] = f"x86_64 under qemu -cpu {X86[target]}"
            if doc.get("error"):
                print(f"{target:<10} failed: {doc['error']}")
            for r in doc["rows"]:
                ratio = (r["abs_diff"] / r["bound"]) if r["abs_diff"] is not None and r["bound"] else None
                fid = "ok" if r["fidelity"] else ("FAIL" if r["fidelity"] is False else "-")
                print(f"{target:<10} {r['bundle']:<22} {r['variant']:<8} {_g(r['abs_diff']):>19} {_g(r['bound']):>10} "
                      f"{_g(ratio, '.3f'):>7} {fid:>8} {_g(r['pre_max_abs']):>11} {_g(r['pre_levels'], '.2f'):>6} "
                      f"{_g(r['pre_differing'], '.3f'):>7}  {doc['isa']}" + (f"  error: {r['error']}" if r["error"] else ""))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
