"""Transient failures heal: when nothing serves only because of latency (a busy machine at boot), the
agent proves the bundle again while it is up, on a backoff schedule, and serves once one passes.

The self-test child already re-measures latency a few times within one proof (seconds apart); this is
the schedule after that (tens of seconds to many minutes apart), so a load that lasts longer than one
boot's proof never leaves the device dark for good. Health shows the schedule and the next attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class ReproofSchedule:
    first_s: float = 30.0
    max_s: float = 900.0

    @property
    def enabled(self) -> bool:
        return self.first_s > 0

    def delay(self, attempt: int) -> float:
        """The wait before re-proof `attempt` (0-based): first_s, doubling, capped at max_s."""
        return min(self.first_s * 2.0 ** attempt, max(self.max_s, self.first_s))


def too_slow_only(report: Mapping[str, Any] | None) -> bool:
    """The one refusal a quieter machine can clear: every tried candidate failed on latency alone."""
    return bool(report) and not report.get("passed") and bool(report.get("too_slow"))  # type: ignore[union-attr]


class Reproof:
    """The state of the re-proof schedule; driven by the controller's loop (one thread)."""

    def __init__(self, schedule: ReproofSchedule, clock: Callable[[], float] = time.monotonic):
        self.schedule, self.clock = schedule, clock
        self.armed = False
        self.attempts = 0     # re-proofs run since it was armed
        self.passed = 0       # times a re-proof turned "not serving" into serving
        self.next_at: float | None = None
        self.reason: str | None = None
        self.last: dict[str, Any] | None = None

    def after_proof(self, report: Mapping[str, Any] | None, serving: bool, reason: str | None) -> None:
        """After any proof (boot, reload, re-proof): arm, move on, or stop the schedule."""
        if serving or not self.schedule.enabled or not too_slow_only(report):
            if self.armed and serving:
                self.passed += 1
            self.armed, self.next_at = False, None
            if serving:
                self.attempts = 0
            return
        if self.armed:
            self.attempts += 1
        self.armed, self.reason = True, reason
        self.next_at = self.clock() + self.schedule.delay(self.attempts)

    def due(self) -> bool:
        return self.armed and self.next_at is not None and self.clock() >= self.next_at

    def started(self) -> None:
        self.next_at = None  # running now; after_proof sets the next one
        self.last = {"attempt": self.attempts + 1, "started_unix": round(time.time(), 3)}

    def to_dict(self) -> dict[str, Any]:
        left = None if self.next_at is None else max(0.0, self.next_at - self.clock())
        return {"armed": self.armed, "attempts": self.attempts, "healed": self.passed,
                "next_attempt_in_s": None if left is None else round(left, 1),
                "next_attempt_unix": None if left is None else round(time.time() + left, 1),
                "schedule_s": [self.schedule.delay(i) for i in range(6)] if self.schedule.enabled else [],
                "reason": self.reason if self.armed else None, "last": self.last}
