"""What every delivery path shares: the interface each implements, how its threads start, and the bounds
asked before a first byte is written (agent.updates.delivery says the policy).

The thread model, one for all three paths:
- a delivery's own loop (`Delivery.run`: the chunk sweeper, the inbox watcher; a URL has none) runs on one
  thread that `start_deliveries` starts and the agent's stop event ends;
- receiving runs where the bytes arrive (MQTT chunks on the controller's thread, a URL's body on its
  command's job thread, an inbox file on the watcher's thread), after `Updater.begin` took the machine;
- the update's work (`Updater.install`, which drives the states) runs on a job thread: `spawn_job` for a
  transfer whose `done` arrived on the controller's thread, the command's job thread for a URL, the
  watcher's own thread for an inbox file (it files the entry away by the verdict before the next one).
The machine's state, never a lock here, is the "one update at a time".
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from agent.logsetup import get_logger

log = get_logger("delivery")


@runtime_checkable
class Delivery(Protocol):
    """One way bundles arrive: `origin` names it in every status; `run` is its own loop until `stop`."""

    origin: str

    def run(self, stop: threading.Event) -> None: ...


def start_deliveries(deliveries: list[Delivery], stop: threading.Event) -> list[threading.Thread]:
    """Each delivery's loop on its own daemon thread, named by its origin."""
    threads = [threading.Thread(target=d.run, args=(stop,), name=f"delivery-{d.origin}", daemon=True)
               for d in deliveries]
    for t in threads:
        t.start()
    return threads


def spawn_job(name: str, fn: Callable[[], Any]) -> threading.Thread:
    """An update's work off the thread that received it (the controller's must never wait on a proof)."""
    t = threading.Thread(target=fn, name=name, daemon=True)
    t.start()
    return t


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_refusal(what: str, size: int, where: Path, min_free: int, copies: int = 2) -> str | None:
    """Why a bundle of `size` bytes cannot be taken under `where`, or None: the archive and its unpacked copy
    (`copies` of its size: 1 when the archive already lies on that disk) must fit with updates.min_free_bytes
    to spare. Every delivery path asks before its first byte is written (an offer, a URL's Content-Length,
    an inbox file): the URL and inbox paths used to write until the disk was full."""
    free = free_bytes(where)
    if copies * size + min_free <= free:
        return None
    return (f"{what} of {size} bytes does not fit: {free} bytes free under {where} "
            f"(needs {copies}x the archive plus updates.min_free_bytes {min_free})")



class RateLimitedWarnings:
    """A warning repeated by a flood (2,000 wrong-size chunks) is logged once per interval per event, with
    the count of the ones left out."""

    def __init__(self, logger: Any, interval_s: float = 10.0):
        self.log, self.interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, event: str, **kw: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(event, -1e9) < self.interval_s:
            self._quiet[event] = self._quiet.get(event, 0) + 1
            return
        self._last[event] = now
        self.log.warning(event, suppressed=self._quiet.pop(event, 0), **kw)

