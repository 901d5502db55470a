"""The updates' side of the controller: it starts the update machinery, takes `update`/`rollback`
commands, and is the host the updater switches, restores and watches the serving state through.

The updater runs on a job thread; every change it makes to what serves goes through `Controller.call`,
so the serving state keeps one writer. Probation is ended by the controller's loop (`probation_tick`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from agent.bundle.load import Bundle
from agent.config import Config
from agent.errors import AgentError
from agent.logsetup import get_logger
from agent.serving.engine import Engine
from agent.serving.pipeline import Pipeline
from agent.service.boot import open_engine
from agent.service.events import Reply
from agent.service.served import Snapshot
from agent.updates.commands import CommandRefused, UrlUpdate, is_repeat, parse_update_command, repeat_reply
from agent.updates.intake import spawn_job, start_deliveries
from agent.updates.probation import probation_over

if TYPE_CHECKING:
    from agent.link.mqtt import Command
    from agent.proof.verdict import Candidate
    from agent.serving.pipeline import EngineTally
    from agent.service.controller import Controller
    from agent.updates.delivery import ChunkReceiver, Downloader
    from agent.updates.store import BundleStore
    from agent.updates.updater import Updater

log = get_logger("controller")


@dataclass(frozen=True)
class Swap:
    """An update's switch: what `restore` puts back, and the engine probation watches."""

    previous: Snapshot
    engine: Engine
    pipeline: Pipeline


@dataclass
class ProbationWatch:
    """A probation in progress: the controller's tick ends it, the update's job thread waits on `done`."""

    tally: EngineTally
    limit_s: float
    limit_results: int
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self) -> None:
        if not self.done.is_set():
            self.seconds = time.monotonic() - self.started
            self.done.set()


class UpdateHost:
    """Owns the store, the updater, its deliveries, the probation in progress and the update job thread."""

    def __init__(self, hub: Controller):
        self.hub = hub
        self.store: BundleStore | None = None
        self.updater: Updater | None = None
        self.receiver: ChunkReceiver | None = None
        self.downloader: Downloader | None = None
        self.thread: threading.Thread | None = None  # the update/rollback command's job thread
        self._probation: ProbationWatch | None = None  # ended by probation_tick, on the controller's thread
        self._url_committed: tuple[str, str] | None = None  # (id, sha256) of the last URL update committed

    # -- the updater's host (agent.updates.updater.ServingAgent) ---------------------------------------
    @property
    def bundle(self) -> Bundle | None:
        return self.hub.served.bundle

    def operation(self, name: str) -> ContextManager[None]:
        return self.hub.slot.hold(name)

    def stopping(self) -> bool:
        return self.hub.stop_event.is_set()

    def swap_bundle(self, bundle: Bundle, candidate: Candidate, report: dict[str, Any]) -> Swap:
        hub = self.hub
        engine = open_engine(bundle, candidate, hub.cfg)  # the proven candidate; opened off the controller

        def apply() -> Swap:
            s = hub.served
            if hub.stop_event.is_set():
                raise AgentError("the agent is stopping: the update is not switched in")
            if s.pipeline is not None and s.pipeline.paused.is_set():
                # probation judges served frames: a paused pipeline serves none, whatever the bundle
                raise AgentError("serving is paused (pause command): send resume, then offer the update again")
            previous = s.snapshot()
            s.put(Snapshot(bundle, engine, report, None))
            s.serve_engine()
            hub.status.publish_selftest()
            hub.status.publish_health()
            assert s.pipeline is not None  # started above when it was not serving
            return Swap(previous, engine, s.pipeline)

        result: Swap = hub.call(apply)
        return result

    def restore(self, swap: Swap) -> None:
        hub = self.hub

        def apply() -> None:
            s = hub.served
            s.put(swap.previous)
            if s.engine is not None and s.serving:
                assert s.pipeline is not None
                s.pipeline.swap_engine(s.engine)
                s.retarget_decode()
            elif s.engine is None:
                s.stop_pipeline()
                s.pipeline = None
            hub.status.publish_selftest()
            hub.status.publish_health()

        hub.call(apply)

    def watch_probation(self, swap: Swap, seconds: float, results: int) -> tuple[Any, float]:
        """Job thread: hand the probation to the controller's tick and wait for its end (no sleep-poll here).
        Returns the new engine's tally and the seconds it was watched."""
        watch = ProbationWatch(swap.pipeline.tally(swap.engine), seconds, results)
        self.hub.call(lambda: setattr(self, "_probation", watch))
        while not watch.done.wait(0.5):
            if self.hub.loop_done.is_set():  # the controller is gone: what was seen so far is the evidence
                watch.finish()
        return watch.tally, watch.seconds

    def probation_tick(self) -> None:
        """Controller thread, every loop: end the probation in progress when it has seen enough."""
        w = self._probation
        if w is None:
            return
        t = w.tally
        if probation_over(time.monotonic() - w.started, t.results, t.inference_errors + t.non_finite + t.post_refused,
                          self.hub.stop_event.is_set(), w.limit_s, w.limit_results):
            self._probation = None
            w.finish()

    # -- start and config --------------------------------------------------------------------------------
    def start(self) -> None:
        """Before MQTT starts: bundle messages the broker kept for us arrive on connect and need a receiver."""
        hub = self.hub
        if not hub.cfg.updates.enabled:
            return
        from agent.updates.delivery import ChunkReceiver, Downloader
        from agent.updates.store import BundleStore
        from agent.updates.updater import Updater

        self.store = BundleStore(hub.cfg.state_dir / "store")
        self.store.recover()  # only here, before anything can stage: a reload never touches staging
        # the proof of an update runs under the config object that serves (hub.cfg, after any reload)
        self.updater = Updater(self, self.store, hub.cfg.updates, hub.cfg.state_dir, lambda: hub.cfg,
                               hub.status.publish_update, on_owner=hub.on_controller)
        # a power cut mid-update: its verdict, published (committed when the store's commit was reached)
        cut = self.updater.machine.resolve_interrupted(committed=self.store.committed_id)
        if cut is not None:
            hub.status.last_update = {"update": cut.update, "origin": cut.origin, "state": cut.state.value,
                                      "ts": round(cut.since, 3), "phase": cut.state.value, "reason": cut.reason}
        self.receiver, self.downloader = ChunkReceiver(self.updater), Downloader(self.updater)
        start_deliveries([self.receiver, self.downloader], hub.stop_event)  # agent.updates.intake's thread model

    def start_inbox(self) -> None:
        if self.updater is not None and self.hub.cfg.updates.inbox is not None:
            from agent.updates.inbox import InboxWatcher

            start_deliveries([InboxWatcher(self.updater)], self.hub.stop_event)

    def use_config(self, cfg: Config) -> None:
        for holder in (self.updater, self.receiver, self.downloader):  # a revoked key stops verifying now
            if holder is not None:
                holder.cfg = cfg.updates

    def on_bundle_message(self, topic: str, payload: bytes) -> None:
        """Controller thread: one message of a bundle transfer over MQTT."""
        link = self.hub.link
        if self.receiver is None or link is None:
            log.error("bundle.message_ignored", topic=topic, reason="updates are not enabled")
            return
        self.receiver.on_message(topic[len(link.topics.prefix):], payload)

    def in_flight(self) -> bool:
        """An update or rollback still holds the slot or runs: a shutdown waits (bounded) for its last word."""
        return ((self.hub.slot.name or "").startswith(("update", "rollback"))
                or (self.thread is not None and self.thread.is_alive()))

    # -- commands ------------------------------------------------------------------------------------
    def command(self, cmd: Command, reply: Reply) -> None:
        """On the controller's thread: the update machine takes the command or answers busy at once; the
        work runs on a job thread. The machine's state is the only "one at a time" guard."""
        updater, downloader = self.updater, self.downloader
        if updater is None or downloader is None:
            reply({"ok": False, "error": "updates are not enabled (updates.enabled)"})
            return
        try:
            parsed = parse_update_command(cmd.name, cmd.payload)
        except CommandRefused as exc:
            reply({"ok": False, "error": str(exc)})
            return
        uid, sha = parsed.id, None
        if isinstance(parsed, UrlUpdate):
            store, sha = self.store, parsed.sha256
            if store is not None and is_repeat(parsed, updater.machine.snapshot, self._url_committed,
                                               store.current_id, store.committed_id):
                # the same update again (a fleet operator resumed after its first command went out), its
                # bundle still the one serving: its verdict, not a second install
                reply(repeat_reply(parsed, self.hub.status.last_update))
                return
            refused = downloader.refusal(parsed.url, uid)
            if refused is not None:
                reply({"ok": False, "update": refused})
                return
            busy = updater.begin(uid, "url")
            cancel = updater.machine.cancel  # this download's: a newer start hands out another
            url = parsed.url
            work: Callable[[], dict[str, Any]] = lambda: downloader.fetch_started(url, parsed.sha256, uid, cancel)  # noqa: E731
        else:
            busy = updater.begin_rollback(uid)
            work = lambda: updater.rollback_started(uid)  # noqa: E731
        if busy is not None:
            # the delivery's word for a second update while one runs (README "Hostile inputs"): busy
            reply({"ok": False, "already_running": True, "busy": True,
                   "error": f"{busy}; send it again after its verdict"})
            return

        def run() -> None:
            try:
                result = work()
                if cmd.name == "update" and result["state"] == "committed":
                    self._url_committed = (uid, str(sha))  # a plain assignment: read on the controller's thread
                reply({"ok": result["state"] == "committed", "update": result})
            except Exception as exc:
                log.exception("update.command_failed")
                reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        self.thread = spawn_job(f"job-{cmd.name}", run)
