"""The serving agent caps glibc's malloc arenas (agent/service/malloc.py): threads that allocate share two
arenas instead of one each, and the children it starts inherit the cap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Eight threads allocate at once (a barrier holds them alive together), then glibc's malloc_info counts
# the heaps (arenas) this process has.
COUNT_ARENAS = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    from agent.service.malloc import cap_arenas
    capped = cap_arenas() if sys.argv[1] == "cap" else None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = libc.fdopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    barrier = threading.Barrier(9)
    def work():
        p = libc.malloc(1 << 20)  # outside pymalloc: glibc picks this thread's arena
        barrier.wait(); barrier.wait()
        libc.free(ctypes.c_void_p(p))
    ts = [threading.Thread(target=work) for _ in range(8)]
    [t.start() for t in ts]
    barrier.wait()
    with tempfile.TemporaryFile() as f:
        libc.fflush(None)
        fp = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, fp); libc.fclose(fp)
        f.seek(0)
        heaps = f.read().count(b"<heap nr=")
    barrier.wait()
    [t.join() for t in ts]
    print(capped, heaps, os.environ.get("MALLOC_ARENA_MAX"))
""")


def arenas(mode: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr)
    return out.stdout.split()


def test_eight_allocating_threads_share_two_arenas_and_children_inherit_the_cap() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped, heaps, inherited = arenas("cap", env)
    assert capped == "True" and int(heaps) <= 2 and inherited == "2", (capped, heaps, inherited)
    # the same threads without the cap: one arena each (the test can tell the difference)
    _, heaps, _ = arenas("none", env)
    assert int(heaps) >= 8, heaps


def test_an_arena_max_set_in_the_environment_is_left_as_set() -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "4"}
    capped, heaps, inherited = arenas("cap", env)
    assert capped == "False" and inherited == "4" and int(heaps) <= 4, (capped, heaps, inherited)
