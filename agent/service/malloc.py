"""glibc's malloc arenas, capped for a serving agent.

glibc gives each thread that allocates its own arena, up to 8 per core, and an arena keeps what was freed
in it. The agent runs a capture thread per camera, decoder threads, worker pools and a publisher, each
freeing frame-sized buffers in its own arena. Measured on the YOLO-320 agent serving 1080p H.264 RTSP
cameras at 10 fps (`scripts/bench_serving.py --sources 4`, idle 2-core EPYC, 3 December 2026, two
interleaved rounds): one camera 215 / 221 MB by default, 206 / 211 MB with two arenas; four cameras about
the same either way (serving RSS 307 / 304 against 306 / 310 MB: there the decoders' own frames dominate);
CPU per result within the rounds' spread. A fixed mmap threshold cut more (195 / 266 MB in one run) but
cost 19 % more CPU per result: not taken.

`MALLOC_ARENA_MAX` in the environment (a unit's `Environment=`, a user's shell) wins: it is what glibc
read at this process's start, and it is left to the children as set.
"""

from __future__ import annotations

import ctypes
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's arenas at `arenas` (before it starts threads: an arena once made stays) and its
    children's through MALLOC_ARENA_MAX. False where the C library is not glibc or the environment set it."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)  # the self-test child and the spare read it at their start
    try:
        # the C library the interpreter runs on, as agent.proof.spare takes prctl from it (find_library
        # would run `ldconfig -p` in a subprocess: 3 ms of every start)
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # no mallopt (musl's returns 0: no arenas to cap)
        return False
