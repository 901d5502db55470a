"""What each part of a proof cost: wall and CPU milliseconds, in the order the parts ran.

The self-test report carries them (`costs`), so an operator sees where a cold proof spends its time
(probes, each candidate's session and checks, latency runs, reduced-decode scales) before cutting any.
"""

from __future__ import annotations

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
                               "cpu_ms": round((time.process_time() - c0) * 1000, 1)})

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(p) for p in self.parts]
