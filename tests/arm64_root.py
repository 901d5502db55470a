"""An arm64 device on this x86 machine: a debootstrapped Debian 12 arm64 root run under qemu-user (binfmt), with
the official aarch64 wheels of the agent's dependencies and this checkout's agent wheel installed in it.

Cached under $EDGE_AGENT_CACHE: the root (built once), its site-packages (again when the dependency list changes)
and the agent (again when its sources change). Each command runs in a mount namespace of its own (`unshare -m`):
/proc, /dev, a private /tmp and the test's work folder mounted for it, gone with it, so tests run side by side.
/sys is left out on purpose: the host's /sys describes x86 CPUs, and ONNX Runtime's cpuinfo on aarch64 crashed
parsing it under qemu (SIGSEGV on import); without it, cpuinfo falls back and warns.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
ROOTFS = CACHE / "arm64-bookworm"
WHEELS = CACHE / "arm64-wheels"
SITE = "/opt/edge-agent/site"  # the dependencies, inside the root
AGENT = "/opt/edge-agent/agent"  # this checkout's agent, inside the root
PACKAGES = "python3"
# The agent's run-time dependencies (pyproject.toml), as the official aarch64 wheels from the package index.
DEPS = "numpy opencv-python-headless onnxruntime av paho-mqtt pyyaml structlog jsonschema cryptography"
PLATFORMS = [f"manylinux_2_{v}_aarch64" for v in (17, 27, 28, 31, 34, 36)] + ["manylinux2014_aarch64"]
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def step(msg: str) -> None:
    print(f"\n[arm64] {msg}", flush=True)


def binfmt_problem() -> str | None:
    """None when aarch64 binaries run here through qemu-user (binfmt_misc mounted, the qemu-aarch64 entry
    enabled with the F flag, so a chroot needs no interpreter inside it); else why not."""
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], capture_output=True)
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    if not entry.exists():
        return "no qemu-aarch64 binfmt entry (apt-get install qemu-user-static binfmt-support)"
    text = entry.read_text()
    if not text.startswith("enabled"):
        return f"{entry} is not enabled"
    if "flags:" not in text or "F" not in text.split("flags:")[1].split()[0]:
        return f"{entry} lacks the F flag (a chroot would need qemu inside it)"
    return None


def _python() -> str:
    return sys.executable


def ensure_rootfs() -> Path:
    """The arm64 root (debootstrap under emulation: ~5 min once, cached)."""
    from tests.e2e.test_service_nspawn import ensure_rootfs as debootstrapped

    return debootstrapped(ROOTFS, PACKAGES, "arm64")


def _pip(*args: str) -> None:
    subprocess.run([_python(), "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def _target_args() -> list[str]:
    """pip's options for the root's interpreter (CPython 3.11, aarch64, glibc 2.36): wheels only, never a build."""
    out = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def ensure_site(root: Path) -> None:
    """The dependencies' aarch64 wheels, installed by this machine's pip into the root (no pip under emulation)."""
    stamp = root / "opt" / "edge-agent" / ".deps"
    if stamp.exists() and stamp.read_text() == DEPS:
        return
    step(f"aarch64 wheels of {DEPS} into {root}{SITE}")
    WHEELS.mkdir(parents=True, exist_ok=True)
    _pip("download", "-d", str(WHEELS), *_target_args(), *DEPS.split())
    site = root / SITE.lstrip("/")
    shutil.rmtree(site, ignore_errors=True)
    _pip("install", "--target", str(site), "--no-index", "--find-links", str(WHEELS), *_target_args(), *DEPS.split())
    # byte-compiled here once: the root's CPython 3.11 reads 3.11 bytecode, and compiling under emulation costs
    # seconds in every process
    subprocess.run([_python(), "-m", "compileall", "-q", "-j", "0", str(site)], check=False)
    stamp.write_text(DEPS)


def ensure_agent(root: Path) -> None:
    """This checkout's agent wheel (the one the nspawn test installs) into the root, again when its sources change."""
    from tests.e2e.test_service_nspawn import ensure_wheels, source_key

    key = source_key()
    stamp = root / "opt" / "edge-agent" / ".agent"
    if stamp.exists() and stamp.read_text() == key:
        return
    with open(CACHE / ".nspawn-prepare.lock", "w") as lock:  # the wheelhouse is the nspawn test's, under its lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheels = ensure_wheels()
    wheel = max(wheels.glob("edge_agent*-*.whl"), key=lambda p: p.stat().st_mtime)
    step(f"agent wheel {wheel.name} into {root}{AGENT}")
    dest = root / AGENT.lstrip("/")
    shutil.rmtree(dest, ignore_errors=True)
    _pip("install", "--no-deps", "--target", str(dest), str(wheel))
    subprocess.run([_python(), "-m", "compileall", "-q", "-j", "0", str(dest)], check=False)
    stamp.write_text(key)


def prepared() -> Path:
    """The root with its Python, dependencies and agent, made under one lock (tests of this lane may run at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".arm64-prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        root = ensure_rootfs()
        ensure_site(root)
        ensure_agent(root)
        return root


@dataclass(frozen=True)
class Arm64:
    """Runs commands in the arm64 root with `work` (a host folder) mounted at /work."""

    root: Path
    work: Path

    def run(self, argv: list[str], timeout: float, stdin: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        r = str(self.root)
        inner = ["env", "-i", "PATH=/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1",
                 f"PYTHONPATH={AGENT}:{SITE}", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]
        setup = (f"mount -t proc proc {r}/proc && mount --bind /dev {r}/dev && mount -t tmpfs tmpfs {r}/tmp && "
                 f"mkdir -p {r}/work && mount --bind {self.work} {r}/work && cd / && exec chroot {r} \"$@\"")
        with open(stdin, "rb") if stdin else open(os.devnull, "rb") as f:
            out = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", setup, "sh", *inner], stdin=f,
                                 capture_output=True, timeout=timeout)
        return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(errors="replace"),
                                           out.stderr.decode(errors="replace"))

    def agent(self, *args: str, timeout: float = 1800, stdin: Path | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(["python3", "-m", "agent", "--log-json", *args], timeout, stdin)
