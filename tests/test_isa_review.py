"""Review of issue 41's device ISA (agent/proof/isa.py): where it reports something other than the process sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QEMU_X86 = shutil.which("qemu-x86_64-static")


@pytest.mark.slow
@pytest.mark.skipif(QEMU_X86 is None, reason="needs qemu-x86_64-static")
@pytest.mark.xfail(strict=True, reason="not fixed in review: on x86 the features come from /proc/cpuinfo, which "
                   "is the host's under qemu-user (CPUID, which numpy's dispatcher reads, is the emulated CPU's)")
def test_an_x86_process_under_qemu_reports_the_emulated_cpus_features_not_the_hosts() -> None:
    """Under `qemu-x86_64 -cpu Nehalem` (SSE4.2, no AVX) the report said the host's AVX-512/VNNI;
    scripts/isa_reproduction.py overrides the line by hand for that reason. The features an INT8 reproduction
    depends on must be the ones the kernels can dispatch to."""
    code = ("import json; from agent.proof.isa import cpu_isa; "
            "from numpy._core._multiarray_umath import __cpu_features__ as f; "
            "print(json.dumps([cpu_isa(), f.get('AVX2', False)]))")
    out = subprocess.run([QEMU_X86, "-cpu", "Nehalem", sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    isa, numpy_avx2 = json.loads(out.stdout.strip().splitlines()[-1])
    assert not numpy_avx2  # the emulated CPU has no AVX2: numpy's CPUID sees it
    assert "avx2" not in isa["features"] and "avx512f" not in isa["features"], isa
