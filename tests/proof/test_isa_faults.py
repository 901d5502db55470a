"""Review of issue 41's device ISA (agent/proof/isa.py): where it reports something other than the process sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def test_a_32_bit_process_on_an_arm64_kernel_reports_no_arm64_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raspberry Pi OS 32-bit boots a 64-bit kernel on a Pi 4/5: uname says aarch64, but the process's HWCAP words
    are the 32-bit layout (bit 20 is LPAE there, read as `asimddp`: a Cortex-A72 reported with dot products).
    Whatever a 32-bit process is told, it is not the aarch64 table's. (No 32-bit ARM process runs here: the
    pointer width and the HWCAP word are stood in for; the word is a Cortex-A72's under a compat process.)"""
    from agent.proof import isa

    a72_compat = sum(1 << b for b in (1, 2, 4, 6, 7, 12, 13, 15, 16, 17, 18, 19, 20, 21))  # arm32 hwcap.h
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(isa, "_pointer_bits", lambda: 32, raising=False)

    class Libc:
        @staticmethod
        def getauxval(key: int) -> int:
            return a72_compat if key == 16 else 0

    monkeypatch.setattr(isa.ctypes, "CDLL", lambda _name: Libc())
    isa.cpu_isa.cache_clear()
    try:
        got = isa.cpu_isa()
        assert "asimddp" not in got["features"], got
        assert got["from"] != "hwcap", got
    finally:
        isa.cpu_isa.cache_clear()
