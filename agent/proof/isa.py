"""This device's instruction set as the running process sees it: the architecture and the features the proof's
answers can depend on (SIMD width, INT8 dot products), for the report, health and the fleet's facts.

From the device, never the build: on arm64 the kernel's HWCAP words (what this process may execute; under
qemu-user the emulated CPU's, where /proc/cpuinfo shows the host's x86 flags), on x86 /proc/cpuinfo's flags.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import re
from pathlib import Path

# The features that change how ONNX Runtime and OpenCV compute: the paths a reproduction bound must hold across.
X86_FEATURES = ("sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_int8", "amx_bf16")
# Linux's AT_HWCAP / AT_HWCAP2 bits on aarch64 (arch/arm64/include/uapi/asm/hwcap.h), the ones that matter here.
_HWCAP = {1: "asimd", 9: "fphp", 10: "asimdhp", 20: "asimddp", 22: "sve", 23: "asimdfhm"}
_HWCAP2 = {1: "sve2", 13: "i8mm", 14: "bf16"}
_AT_HWCAP, _AT_HWCAP2 = 16, 26


def _pointer_bits() -> int:
    return ctypes.sizeof(ctypes.c_void_p) * 8


def _hwcap_features() -> list[str] | None:
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return None
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    words = ((getauxval(_AT_HWCAP), _HWCAP), (getauxval(_AT_HWCAP2), _HWCAP2))
    return [name for word, bits in words for bit, name in sorted(bits.items()) if word >> bit & 1]


def _cpuinfo_flags() -> list[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    if m is None:
        return None
    have = set(m.group(1).split())
    return [f for f in X86_FEATURES if f in have]


@functools.cache
def cpu_isa() -> dict[str, object]:
    """{"machine": "aarch64" | "x86_64" | ..., "features": [...], "from": "hwcap" | "cpuinfo" | "unknown"}."""
    machine = platform.machine()
    if machine in ("aarch64", "arm64") and _pointer_bits() == 64:
        feats, origin = _hwcap_features(), "hwcap"
    elif machine in ("x86_64", "AMD64", "i686", "i386"):
        feats, origin = _cpuinfo_flags(), "cpuinfo"
    else:  # other machines, and a 32-bit process on an arm64 kernel (uname says aarch64; its HWCAP is arm32's)
        feats, origin = None, "unknown"
    return {"machine": machine, "features": list(feats or []), "from": origin if feats is not None else "unknown"}


def isa_line() -> str:
    """One line for cache keys and logs: `aarch64: asimd asimddp ...`."""
    isa = cpu_isa()
    features = isa["features"]
    return f"{isa['machine']}: {' '.join(features) if isinstance(features, list) else ''}".strip()


__all__ = ["X86_FEATURES", "cpu_isa", "isa_line"]
