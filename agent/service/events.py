"""The events other threads post to the controller's one bounded queue."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agent.link.mqtt import Command

Reply = Callable[[dict[str, Any]], None]
EVENT_QUEUE_SIZE = 64  # bounded: a full queue is answered "busy", never a new thread


@dataclass(frozen=True)
class CommandEvent:
    cmd: Command
    reply: Reply


@dataclass(frozen=True)
class BundleMessage:
    topic: str
    payload: bytes


@dataclass(frozen=True)
class UpdateStatus:
    """An update/status document from a delivery or the updater: the controller keeps and publishes it."""

    doc: dict[str, Any]


@dataclass
class Call:
    """Run `fn` on the controller's thread; the poster waits for `done`."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
