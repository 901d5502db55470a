"""The events other threads post to the controller's one bounded queue."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from agent.errors import Stopping

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


class Mailbox:
    """The controller's one bounded queue, and `call`: how any other thread gets work done on its thread."""

    def __init__(self) -> None:
        self.events: queue.Queue[Any] = queue.Queue(maxsize=EVENT_QUEUE_SIZE)
        self.owner: threading.Thread | None = None  # the controller's own thread, once run() starts
        self.loop_done = threading.Event()  # the loop has ended: nothing takes events any more

    def post(self, event: Any, timeout: float | None = None) -> bool:
        """Queue an event for the controller; False when the queue stayed full."""
        try:
            if timeout is None:
                self.events.put_nowait(event)
            else:
                self.events.put(event, timeout=timeout)
            return True
        except queue.Full:
            return False

    def on_own_thread(self) -> bool:
        """True where state may be changed directly: the controller's thread, before run() or after its loop."""
        return self.owner is None or threading.current_thread() is self.owner or self.loop_done.is_set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the controller's thread and return its result (from a job thread)."""
        if self.owner is None or threading.current_thread() is self.owner:
            return fn()
        c = Call(fn)
        while not self.post(c, timeout=0.5):
            if self.loop_done.is_set():
                raise Stopping("the agent is stopping")
        while not c.done.wait(0.1):
            if self.loop_done.is_set() and not c.done.is_set():
                raise Stopping("the agent is stopping")
        if c.error is not None:
            raise c.error
        return c.result

    def on_controller(self, fn: Callable[[], Any]) -> Any:
        """`call`, for an update's transitions: once the controller's loop has ended (shutdown), run inline,
        so an update's last transition (rolled back, cut short) is still recorded."""
        if self.loop_done.is_set():
            return fn()
        try:
            return self.call(fn)
        except Stopping:  # the loop ended before it took `fn` (it never runs a Call after that)
            return fn()
