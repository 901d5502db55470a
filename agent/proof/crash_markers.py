"""The self-test's in-flight marker in `<state_dir>/selftest`: written before each candidate's trial (rewritten
per run in the latency loop), so a marker found at the next start names the candidate that killed the process,
and the skip list the next proof reads."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TypeVar

from agent.fsio import read_json, write_json_atomic
from agent.logsetup import get_logger
from agent.proof.crash_files import INFLIGHT_FILE, SKIP_FILE
from agent.proof.isolation import RunMarker
from agent.proof.verdict import Candidate

log = get_logger("selftest")
T = TypeVar("T")


class CrashMarkers:
    """A marker written before each candidate; one found at start means that candidate killed us."""

    def __init__(self, directory: Path):
        self.inflight = directory / INFLIGHT_FILE
        self.crashed_file = directory / SKIP_FILE

    def recover(self) -> dict[str, str]:
        crashed: dict[str, str] = read_json(self.crashed_file, {}, expect=dict) or {}
        left = read_json(self.inflight, expect=dict)
        if left and left.get("bundle") and left.get("candidate"):
            key = f"{left['bundle']}|{left['candidate']}"
            crashed[key] = left.get("started", "")
            write_json_atomic(self.crashed_file, crashed)
            log.warning("selftest.crash_marker_found", candidate=left["candidate"], bundle=left["bundle"][:12])
        if self.inflight.exists():
            self.inflight.unlink()
        return crashed

    def enter(self, bundle_sha: str, c: Candidate) -> None:
        write_json_atomic(self.inflight, {"bundle": bundle_sha, "candidate": c.key,
                                          "started": datetime.now(timezone.utc).isoformat()})

    def leave(self) -> None:
        self.inflight.unlink(missing_ok=True)

    def interleaved(self, bundle_sha: str, fn: Callable[[Any], T]) -> T:
        """Run `fn(marker)`, a latency loop that switches the in-flight marker per candidate per run."""
        marker = RunMarker(self.inflight, bundle_sha)
        try:
            return fn(marker)
        finally:
            marker.close()
            self.leave()
