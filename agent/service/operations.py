"""The operation slot and the job threads that hold it.

Reload, self-test, update, rollback, re-proof and boot are operations: one at a time, each on its own job
thread. A second request of the same kind while one runs is answered "already running"; another kind,
"busy". The slot's name is what health shows as the operation in progress.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from agent.errors import AgentError
from agent.logsetup import get_logger

log = get_logger("controller")

MAX_OPERATION_CHARS = 160  # an update is named by its URL or file: health and busy replies carry only this much


def _bounded_name(name: str) -> str:
    """An operation's name as health shows it: a 60 KB URL must not ride along in every health message."""
    return name if len(name) <= MAX_OPERATION_CHARS else name[:MAX_OPERATION_CHARS - 1] + "…"


class OperationSlot:
    """Who holds the one operation slot, and the job threads started under it."""

    def __init__(self, stop_event: threading.Event):
        self._stop_event = stop_event
        self._cond = threading.Condition()
        self.name: str | None = None  # read by health and the loop without the lock: a plain attribute read
        self._jobs: list[threading.Thread] = []

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Hold the slot (waits for the operation in progress): an update's or a rollback's."""
        with self._cond:
            while self.name is not None:
                self._cond.wait(0.5)
            self.name = _bounded_name(name)
        try:
            yield
        finally:
            self.release()

    def try_take(self, name: str) -> str | None:
        """Take the slot now, or return who holds it."""
        with self._cond:
            if self.name is not None:
                return self.name
            self.name = _bounded_name(name)
            return None

    def release(self) -> None:
        with self._cond:
            self.name = None
            self._cond.notify_all()

    def spawn(self, name: str, fn: Callable[..., None], *args: Any, release: bool = True) -> None:
        """A job thread for an operation whose slot is already held; it releases the slot when done
        (or `fn` does, on the controller's thread, when `release` is False)."""
        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:
                if isinstance(exc, AgentError) and self._stop_event.is_set():
                    log.info("job.stopped", job=name, reason=str(exc))  # a clean stop while it ran: not an error
                else:
                    log.exception("job.failed", job=name)
            finally:
                if release:
                    self.release()

        t = threading.Thread(target=run, name=f"job-{name}", daemon=True)
        self._jobs = [j for j in self._jobs if j.is_alive()] + [t]
        t.start()
