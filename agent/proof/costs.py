"""What each part of a proof cost: wall and CPU milliseconds and memory, in the order the parts ran.

The self-test report carries them (`costs`), so an operator sees where a cold proof spends its time
(probes, each candidate's session and checks, latency runs, reduced-decode scales) before cutting any,
and where its memory goes: the process's resident set after each part and its peak so far (the proof runs
in a child of its own, so the last part's peak is the child's).
"""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class ProofCosts:
    parts: list[dict[str, Any]] = field(default_factory=list)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time one part: wall clock, and the process's CPU (every thread: ORT's pools count too)."""
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.parts.append({"part": name, "wall_ms": round((time.perf_counter() - t0) * 1000, 1),
                               "cpu_ms": round((time.process_time() - c0) * 1000, 1), **memory_mb()})

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(p) for p in self.parts]


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_mb() -> dict[str, float | None]:
    """The process's resident set now and its peak so far, in MB (Linux: ru_maxrss in KiB)."""
    rss: float | None
    try:
        with open("/proc/self/statm", "rb") as f:
            rss = round(int(f.read().split()[1]) * _PAGE_MB, 1)
    except (OSError, IndexError, ValueError):  # not Linux: the peak only
        rss = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_mb": rss, "peak_rss_mb": round(peak, 1)}
