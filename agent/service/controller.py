"""The controller: one thread owns the agent's state and everything else posts events to it.

Bundle, engine, pipeline, store, updater and outbox belong to the controller. MQTT callbacks, signals,
commands, the inbox and timers reach it through one bounded queue (full: "busy", never a new thread).
Slow work (a self-test child, a reload's proof, an update) runs on one job thread at a time that
holds the *operation* slot, and changes state only through `call`, which runs on the controller's
thread. Reload, self-test and update are operations, so they never interleave; a second request
of the same kind while one runs is answered "already running".
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import queue
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from agent.bundle.load import Bundle
from agent.config import Config, load_config
from agent.errors import AgentError, ConfigError, Stopping
from agent.fsio import bump_counter
from agent.link.health import ProcessProbe, audited
from agent.logsetup import configure_logging, get_logger
from agent.proof import spare
from agent.proof.session import forbid_fd_capture
from agent.serving.engine import Engine
from agent.serving.pipeline import Pipeline, Sink
from agent.serving.sinks import FanOutSink, JsonLinesSink, NullSink, OutboxSink
from agent.serving.multisource import MultiSource
from agent.serving.sources import FrameSource, is_lossless, open_source, retarget_decode, warm_decoder
from agent.service.boot import BootOutcome, boot, memory_dir, open_engine, prove
from agent.service.advice import not_serving_advice
from agent.service import evidence
from agent.service.audit import Auditor, AuditSettings, loud_state
from agent.service.reproof import Reproof, ReproofSchedule
from agent.service.health_view import health_document, status_line, watchdog_withheld
from agent.service.preflight import can_receive_bundle, source_problems
from agent.service.sdnotify import Notifier
from agent.updates.machine import State
from agent.updates.probation import probation_over

if TYPE_CHECKING:  # imported at run time only when updates, MQTT or metrics are enabled (_start_*)
    from agent.link.mqtt import Command, MqttLink
    from agent.link.outbox import Outbox
    from agent.link.prometheus import MetricsServer
    from agent.proof.verdict import Candidate
    from agent.serving.pipeline import EngineTally
    from agent.updates.delivery import ChunkReceiver, Downloader
    from agent.updates.store import BundleStore
    from agent.updates.updater import Updater

log = get_logger("controller")


@dataclass(frozen=True)
class _Served:
    """What served before a reload: restored when the reload's proof or start fails."""

    cfg: Config
    bundle: Bundle | None
    engine: Engine | None
    doc: dict[str, Any] | None

COMMANDS = ("status", "selftest", "reload", "pause", "resume", "update", "rollback", "snapshot")
SNAPSHOT_WAIT_S = 5.0  # cmd/snapshot waits this long (at most SNAPSHOT_WAIT_MAX_S when asked) for a served frame
SNAPSHOT_WAIT_MAX_S = 30.0
EVENT_QUEUE_SIZE = 64
EXIT_PIPELINE_FAILED = 1  # a dead stage: exit non-zero so systemd (Restart=on-failure) restarts us
Reply = Callable[[dict[str, Any]], None]

MAX_OPERATION_CHARS = 160  # an update is named by its URL or file: health and busy replies carry only this much


def _bounded_name(name: str) -> str:
    """An operation's name as health shows it: a 60 KB URL must not ride along in every health message."""
    return name if len(name) <= MAX_OPERATION_CHARS else name[:MAX_OPERATION_CHARS - 1] + "…"


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


@dataclass(frozen=True)
class Swap:
    """An update's switch: what `restore` puts back, and the engine probation watches."""

    previous: tuple[Any, ...]
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


def sources_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Many sources: each one's state and counts, for the health and shutdown log lines."""
    if not doc.get("sources"):
        return {}
    keep = ("state", "frames", "served", "stale", "left_at_stop", "decoder")
    return {"sources": {n: {k: v[k] for k in keep} for n, v in doc["sources"].items()}}


def proven_decode(cfg: Any, report: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """The source settings to open with, and the decode limit: the largest JPEG scale the self-test proved
    on the serving candidate (1 when the report proves none). A forced `source.decode_scale` above it is
    capped, with a warning: a scale the golden samples never saw is not served."""
    dec = (report or {}).get("decode") or {}
    proven = int(dec.get("max_scale", 1)) if isinstance(dec, dict) else 1
    limit: dict[str, Any] = {"max_scale": proven, "proven": proven, "reason": dec.get("reason") if dec else
                             "the self-test report has no reduced-decode check", "forced": None}
    forced = getattr(cfg, "decode_scale", "auto")
    if forced != "auto":
        limit["forced"] = int(forced)
        if int(forced) > proven:
            log.warning("source.decode_scale_capped", configured=int(forced), proven=proven, reason=limit["reason"])
            limit["capped"] = f"source.decode_scale {forced} is above the proven {proven}: decoding at 1/{proven}"
            cfg = dataclasses.replace(cfg, decode_scale=proven)
    return cfg, limit


class Controller:
    """Owns the serving state; runs `run()` on the main thread."""

    def __init__(self, cfg: Config, sink: Sink | None = None):
        self.cfg = cfg
        self.extra_sink = sink
        self.events: queue.Queue[Any] = queue.Queue(maxsize=EVENT_QUEUE_SIZE)
        self.stop_event = threading.Event()
        self._reload_signal = threading.Event()
        self._thread: threading.Thread | None = None  # the controller's own thread, once run() starts
        self._loop_done = threading.Event()
        self._op_cond = threading.Condition()
        self._operation: str | None = None
        self._jobs: list[threading.Thread] = []
        self._reload_pending = False
        self._reload_replies: list[Reply] = []
        self._update_thread: threading.Thread | None = None
        self._probation: ProbationWatch | None = None  # ended by _probation_tick, on this thread
        self.bundle: Bundle | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.selftest_doc: dict[str, Any] | None = None
        self.decode_limit: dict[str, Any] | None = None  # the proven JPEG decode scale the source runs under
        self.not_serving_reason: str | None = None
        # this agent process, drawn at start: in availability, health and every result, so two live agents
        # under one device_id (a cloned card: the same state dir, the same boot counter) stay distinguishable
        self.instance = uuid.uuid4().hex[:12]
        self.reload_refused: dict[str, Any] | None = None  # the last reload that kept the proven engine, and why
        self.config_refused: str | None = None  # set at boot: `run` exits non-zero instead of idling forever
        self.store: BundleStore | None = None
        self.updater: Updater | None = None
        self.receiver: ChunkReceiver | None = None
        self.downloader: Downloader | None = None
        self.metrics_server: MetricsServer | None = None
        self.live_view: Any = None  # agent.link.liveview.LiveView with metrics.live_view or MQTT (cmd/snapshot)
        self._snapshot_busy = False  # a cmd/snapshot job is waiting for its frames
        self.link: MqttLink | None = None
        self.outbox: Outbox | None = None
        self.started = time.monotonic()
        self.probe = ProcessProbe()
        self.notifier = Notifier()
        self.boot_number = 0
        self._next_seq = 1  # seq never repeats within a boot, across reloads and updates
        self._last_update: dict[str, Any] | None = None
        self._url_committed: tuple[str, str] | None = None  # (id, sha256) of the last URL update committed
        self._last_failure: dict[str, Any] | None = None  # the last rejected / rolled-back update, for the facts
        self._last_health: dict[str, Any] | None = None
        self._last_health_key: Any = None
        self._loud_logged: str | None = None  # the loud state (pinned, degraded) the journal last said
        sel = cfg.selection  # re-proof while up when nothing serves only because of latency (reproof.py)
        self.reproof = Reproof(ReproofSchedule(sel.reproof_backoff_s, sel.reproof_max_backoff_s))
        # keep proving while serving (audit.py): canary and live audit on their own thread
        self.auditor = Auditor(AuditSettings.from_config(cfg), lambda: self.engine if self.serving else None,
                               cfg.session)
        self.auditor.latency_histogram = lambda: self.pipeline.metrics.histograms_ms["inference"] if self.pipeline else None

    # -- any thread ----------------------------------------------------------------------------------
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

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the controller's thread and return its result (from a job thread)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        c = Call(fn)
        while not self.post(c, timeout=0.5):
            if self._loop_done.is_set():
                raise Stopping("the agent is stopping")
        while not c.done.wait(0.1):
            if self._loop_done.is_set() and not c.done.is_set():
                raise Stopping("the agent is stopping")
        if c.error is not None:
            raise c.error
        return c.result

    def on_controller(self, fn: Callable[[], Any]) -> Any:
        """`call`, for an update's transitions: once the controller's loop has ended (shutdown), run inline,
        so an update's last transition (rolled back, cut short) is still recorded."""
        if self._loop_done.is_set():
            return fn()
        try:
            return self.call(fn)
        except Stopping:  # the loop ended before it took `fn` (it never runs a Call after that)
            return fn()

    @contextmanager
    def operation(self, name: str) -> Iterator[None]:
        """Hold the operation slot (waits for the one in progress): reload, self-test, update, boot."""
        with self._op_cond:
            while self._operation is not None:
                self._op_cond.wait(0.5)
            self._operation = _bounded_name(name)
        try:
            yield
        finally:
            self._release_operation()

    def _try_operation(self, name: str) -> str | None:
        """Take the slot now, or return who holds it."""
        with self._op_cond:
            if self._operation is not None:
                return self._operation
            self._operation = _bounded_name(name)
            return None

    def _release_operation(self) -> None:
        with self._op_cond:
            self._operation = None
            self._op_cond.notify_all()

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()

    def request_reload(self, *_: Any) -> None:
        self._reload_signal.set()

    def command_inlet(self) -> "CommandInlet":
        return CommandInlet(self)

    def on_bundle_message(self, topic: str, payload: bytes) -> None:
        """paho's thread: a bundle transfer message. Waits a moment for room (back-pressure on the broker)."""
        if not self.post(BundleMessage(topic, payload), timeout=5):
            log.error("bundle.message_dropped", topic=topic, reason="controller queue full for 5 s")

    # -- state (controller thread) ---------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        p = self.pipeline
        return p is not None and not p.done.is_set() and p.failed is None

    def _sink(self) -> Sink:
        sinks: list[Sink] = []
        if self.cfg.output.stdout:
            sinks.append(JsonLinesSink())
        if self.outbox is not None and self.link is not None:
            topics = self.link.topics
            sinks.append(OutboxSink(self.outbox, topics.predictions, self.cfg.mqtt.qos, self.cfg.mqtt.batch_predictions,
                                    topic_for=topics.source_predictions if self.cfg.sources else None,
                                    stream_topic_for=topics.stream_predictions))
        if self.extra_sink is not None:
            sinks.append(self.extra_sink)
        return FanOutSink(*sinks) if sinks else NullSink()

    def _start_pipeline(self) -> Pipeline:
        assert self.engine is not None and self.bundle is not None
        if self.stop_event.is_set():  # a boot or an update that finishes during shutdown serves nothing
            raise AgentError("the agent is stopping")
        m = self.bundle.manifest
        opened: list[tuple[Any, FrameSource]] = []
        try:
            for cfg in self.cfg.source_list:
                src_cfg, self.decode_limit = proven_decode(cfg, self.selftest_doc)
                opened.append((cfg, open_source(src_cfg, m.frame, m.preprocess.resize,
                                                max_scale=self.decode_limit["max_scale"])))
        except AgentError:
            for _, src in opened:
                src.close()
            raise
        if self.cfg.sources:  # many sources, one session: each source keeps its own policy inside
            source: FrameSource = MultiSource(opened, capacity=self.cfg.pipeline.queue_size)
            lossless = True
        else:
            source, lossless = opened[0][1], is_lossless(self.cfg.source, opened[0][1])
        self.pipeline = Pipeline(source, self.engine, self._sink(), self.cfg.pipeline, lossless,
                                 boot=self.boot_number, first_seq=self._next_seq, instance=self.instance)
        self.pipeline.max_result_bytes = self.cfg.output.max_result_bytes
        self.pipeline.live = self.live_view
        log.info("pipeline.start", source=source.name, lossless=self.pipeline.lossless, first_seq=self._next_seq)
        return self.pipeline.start()

    def _retarget_decode(self) -> None:
        """A swapped bundle brings its own resize and proven decode scale: the running source takes them for
        the next frame (a frame in flight carries the scale it was decoded at, so its boxes still map back)."""
        assert self.pipeline is not None and self.bundle is not None
        _, self.decode_limit = proven_decode(self.cfg.source_list[0], self.selftest_doc)
        src = self.pipeline.source
        for s in ([f.source for f in src.feeds] if isinstance(src, MultiSource) else [src]):
            retarget_decode(s, self.bundle.manifest.preprocess.resize, self.decode_limit["max_scale"])

    def _stop_pipeline(self) -> None:
        p = self.pipeline
        if p is None:
            return
        p.stop()
        p.join(timeout=30)
        p.close_source()  # after capture left read(); if it is still inside, capture closes it on its way out
        self._next_seq = max(self._next_seq, p.last_seq + 1)

    def _apply_boot(self, o: BootOutcome) -> None:
        self.bundle, self.engine, self.not_serving_reason = o.bundle, o.engine, o.reason
        if o.report is not None:
            self.selftest_doc = o.report
        if o.engine is not None:
            try:
                self._start_pipeline()
            except ConfigError as exc:  # the config names a source that cannot open: no command can fix it
                self.engine, self.not_serving_reason = None, str(exc)
                self.config_refused = str(exc)
            except AgentError as exc:
                self.engine, self.not_serving_reason = None, str(exc)
        if self.not_serving_reason is not None and (o.refused or (o.unservable and not can_receive_bundle(self.cfg))):
            self.config_refused = self.not_serving_reason  # no bundle can ever come: exit 1, not idle forever
        if self.not_serving_reason is None:
            assert self.engine is not None  # no reason: a proven engine serves
            log.info("boot.ready", **self.engine.describe())
            loud = loud_state(self.selftest_doc, None)
            if loud:  # pinned below floor, too slow: in the journal, not only in health
                log.warning("boot.serving_loudly", state=loud, warnings=(self.selftest_doc or {}).get("warnings"))
            self._loud_logged = loud
        self.reproof.after_proof(o.report, self.serving, self.not_serving_reason)
        if self.reproof.armed:
            log.warning("reproof.scheduled", **self.reproof.to_dict())
        if self.not_serving_reason is not None:
            # the reason, the figure against its bound, the key to change and the next attempt, at once
            log.error("boot.not_serving", reason=self.not_serving_reason,
                      **not_serving_advice(self.not_serving_reason, self.selftest_doc if o.report else None,
                                           self.reproof.to_dict(), can_receive_bundle(self.cfg)))
        self._publish_selftest()

    # -- updates (called by the updater, on its thread) --------------------------------------------------
    def swap_bundle(self, bundle: Bundle, candidate: Candidate, report: dict[str, Any]) -> Swap:
        engine = open_engine(bundle, candidate, self.cfg)  # the proven candidate; opened off the controller

        def apply() -> Swap:
            if self.stop_event.is_set():
                raise AgentError("the agent is stopping: the update is not switched in")
            if self.pipeline is not None and self.pipeline.paused.is_set():
                # probation judges served frames: a paused pipeline serves none, whatever the bundle
                raise AgentError("serving is paused (pause command): send resume, then offer the update again")
            previous = (self.bundle, self.engine, self.selftest_doc, self.not_serving_reason)
            self.bundle, self.engine, self.selftest_doc, self.not_serving_reason = bundle, engine, report, None
            if self.serving:
                assert self.pipeline is not None  # serving means a live pipeline
                self.pipeline.swap_engine(engine)
                self._retarget_decode()
            else:
                self._stop_pipeline()
                self._start_pipeline()
            self._publish_selftest()
            self._publish_health()
            assert self.pipeline is not None  # started above when it was not serving
            return Swap(previous, engine, self.pipeline)

        return self.call(apply)

    def restore(self, swap: Swap) -> None:
        def apply() -> None:
            self.bundle, self.engine, self.selftest_doc, self.not_serving_reason = swap.previous
            if self.engine is not None and self.serving:
                assert self.pipeline is not None
                self.pipeline.swap_engine(self.engine)
                self._retarget_decode()
            elif self.engine is None:
                self._stop_pipeline()
                self.pipeline = None
            self._publish_selftest()
            self._publish_health()

        self.call(apply)

    def watch_probation(self, swap: Swap, seconds: float, results: int) -> tuple[Any, float]:
        """Job thread: hand the probation to the controller's tick and wait for its end (no sleep-poll here).
        Returns the new engine's tally and the seconds it was watched."""
        watch = ProbationWatch(swap.pipeline.tally(swap.engine), seconds, results)
        self.call(lambda: setattr(self, "_probation", watch))
        while not watch.done.wait(0.5):
            if self._loop_done.is_set():  # the controller is gone: what was seen so far is the evidence
                watch.finish()
        return watch.tally, watch.seconds

    def _probation_tick(self) -> None:
        """Controller thread, every loop: end the probation in progress when it has seen enough."""
        w = self._probation
        if w is None:
            return
        t = w.tally
        if probation_over(time.monotonic() - w.started, t.results, t.inference_errors + t.non_finite + t.post_refused,
                          self.stop_event.is_set(), w.limit_s, w.limit_results):
            self._probation = None
            w.finish()

    # -- health ----------------------------------------------------------------------------------------
    def health_snapshot(self) -> dict[str, Any]:
        """What /metrics reads, on its HTTP thread: the health document the controller last published (every
        output.health_interval_s and on every change), never live engine, pipeline or outbox state."""
        doc = self._last_health
        if doc is None:  # before the first publish: say so rather than read live state from another thread
            return {"device_id": self.cfg.device_id, "serving": False, "not_serving_reason": "starting",
                    "uptime_s": round(time.monotonic() - self.started, 1)}
        return doc

    def pipeline_metrics(self) -> Any:
        """The live pipeline's histograms for /metrics (None while nothing serves)."""
        return self.pipeline.metrics if self.pipeline is not None else None

    def health(self) -> dict[str, Any]:
        doc = health_document(
            device_id=self.cfg.device_id, started=self.started, session=self.link.session if self.link else 0,
            interval_s=self.cfg.output.health_interval_s, serving=self.serving,
            not_serving_reason=None if self.serving else (self.not_serving_reason or self._idle_reason()),
            engine=self.engine, pipeline=self.pipeline, selftest_doc=self.selftest_doc, outbox=self.outbox,
            probe=self.probe, operation=self._operation, decode_limit=self.decode_limit,
            mqtt_connected=self.link.connected.is_set() if self.link is not None else None, update=self._last_update,
            update_machine=self.updater.machine.snapshot.to_dict() if self.updater is not None else None,
        ) | {"reproof": self.reproof.to_dict(), "audit": self.auditor.to_dict(), "reload_refused": self.reload_refused,
              "identity": {"instance": self.instance, "twin": self.link.twin if self.link is not None else None}}
        if doc["selftest"]:  # drift while serving: the proof's verdict is degraded here too, never "pass"
            doc["selftest"] = audited(doc["selftest"], doc["audit"])
        return doc

    def _status_text(self) -> str:
        """systemd's STATUS=, with what an operator must see beside "serving" (degraded, pinned); never "None"."""
        loud = loud_state(self.selftest_doc, self.auditor.to_dict()) if self.serving else None
        line = status_line(self.serving, self.engine, self.not_serving_reason or self._idle_reason())
        return f"{line} — {loud}" if loud else line

    def _journal_loud(self) -> None:
        """A loud state that newly applies (an update or rollback that serves a pinned below-floor
        candidate, a drift) goes to the journal once, as the boot's does; STATUS says it at the same time."""
        loud = loud_state(self.selftest_doc, self.auditor.to_dict()) if self.serving else None
        if loud and loud != self._loud_logged:
            log.warning("serving.loud", state=loud, status=self._status_text(),
                        warnings=(self.selftest_doc or {}).get("warnings"))
        self._loud_logged = loud

    def _idle_reason(self) -> str:
        p = self.pipeline
        if p is not None and p.failed is not None:
            return p.failed
        if p is not None and p.done.is_set():
            return "the source ended"
        return f"{self._operation} in progress" if self._operation else "not started"

    def _publish_health(self) -> dict[str, Any]:
        doc = self._last_health = self.health()
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
            for name, one in (doc.get("sources") or {}).items():
                self.link.publish_retained(self.link.topics.source_health(name),
                                           json.dumps({"ts": doc["ts"], "source": name, **one}).encode())
        return doc

    def _health_key(self) -> Any:
        p = self.pipeline
        # the STATUS text itself: an update that keeps the variant changes the version it names and may
        # bring a loud state (pinned below floor) with it
        return (self.serving, self.not_serving_reason, self._status_text(), self.auditor.to_dict()["state"],
                p.source.stats.state if p else None, bool(p and p.paused.is_set()), p.failed if p else None,
                getattr(p.source, "state_key", lambda: None)() if p else None)  # many sources: one turns stuck

    def _publish_selftest(self) -> None:
        if self.link is not None and self.selftest_doc is not None:
            self.link.publish_retained(self.link.topics.selftest, json.dumps(self.selftest_doc).encode())
        self._publish_facts()

    def _facts(self) -> dict[str, Any]:
        """The retained facts a fleet rollout targets on and gates with (agent/fleet/facts.py)."""
        from agent.fleet.facts import device_facts
        from agent.link.health import versions
        from agent.proof.isa import cpu_isa

        b = self.bundle
        return device_facts(
            device_id=self.cfg.device_id, session=self.link.session if self.link else 0, labels=self.cfg.labels,
            versions=versions(), report=self.selftest_doc,
            effective=list(self.engine.describe()["effective_providers"]) if self.engine else None,
            current=self.store.current_id if self.store else None,
            committed=self.store.committed_id if self.store else None,
            active=None if b is None else {"name": b.manifest.name, "version": b.manifest.version,
                                           "sha": b.manifest_sha256[:12]},
            last_failure=self._last_failure,
            budget_ms=b.manifest.selftest.budget_for(self.engine.describe()["provider"]) if b and self.engine else None,
            device=cpu_isa())

    def _publish_facts(self) -> None:
        if self.link is not None:
            self.link.publish_retained(self.link.topics.facts, json.dumps(self._facts()).encode())

    def _retained(self) -> dict[str, bytes]:
        """paho's thread, on connect: the last documents the controller published (never its live state)."""
        assert self.link is not None  # called by the link itself
        topics = self.link.topics
        out = {}
        if self._last_health is not None:
            out[topics.health] = json.dumps(self._last_health).encode()
        if self.selftest_doc is not None:
            out[topics.selftest] = json.dumps(self.selftest_doc).encode()
        if self._last_update is not None:
            out[topics.update_status] = json.dumps(self._last_update).encode()
        out[topics.facts] = json.dumps(self._facts()).encode()
        if self.cfg.mqtt.homeassistant:
            from agent.link.discovery import discovery_messages

            out.update(discovery_messages(self.cfg, topics))
        return out

    def _publish_update(self, doc: dict[str, Any]) -> None:
        """Any thread: the status goes to the controller's queue, so `_last_update` has one writer."""
        if self._thread is None or threading.current_thread() is self._thread or self._loop_done.is_set():
            self._apply_update_status(doc)
        elif not self.post(UpdateStatus(doc), timeout=5):
            log.error("update.status_dropped", update=doc.get("update"), state=doc.get("state"),
                      reason="controller queue full for 5 s")

    def _apply_update_status(self, doc: dict[str, Any]) -> None:
        self._last_update = doc
        if self.link is not None:
            self.link.publish_retained(self.link.topics.update_status, json.dumps(doc).encode())
        if doc.get("state") in ("committed", "rejected", "rolled_back"):
            if doc["state"] != "committed":
                self._last_failure = doc
            self._publish_facts()  # after the verdict: a rollout counts a commit once the facts show it

    def _watchdog(self) -> None:
        """Feed only while frames really flow, or while not serving by design; a dead or hung stage misses it."""
        reason = watchdog_withheld(self.pipeline, max((self.notifier.watchdog_s or 0.0) / 2, 1.0))
        if reason is None:
            self.notifier.watchdog()
        else:
            log.error("watchdog.withheld", reason=reason)
            dead = self.pipeline is not None and self.pipeline.failed is not None
            self.notifier.status(f"{'NOT serving' if dead else 'STALLED'}: {reason}")

    # -- events (controller thread) ------------------------------------------------------------------
    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Call):
            try:
                ev.result = ev.fn()
            except BaseException as exc:  # handed back to the poster, who raises it
                ev.error = exc
            ev.done.set()
        elif isinstance(ev, CommandEvent):
            try:
                self._on_command(ev.cmd, ev.reply)
            except Exception as exc:  # a failing command is an error reply, never a dead controller
                log.exception("command.failed", command=ev.cmd.name)
                ev.reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        elif isinstance(ev, BundleMessage):
            self._on_bundle(ev.topic, ev.payload)
        elif isinstance(ev, UpdateStatus):
            self._apply_update_status(ev.doc)

    def _on_bundle(self, topic: str, payload: bytes) -> None:
        if self.receiver is None or self.link is None:
            log.error("bundle.message_ignored", topic=topic, reason="updates are not enabled")
            return
        self.receiver.on_message(topic[len(self.link.topics.prefix):], payload)

    def _on_command(self, cmd: Command, reply: Reply) -> None:
        name = cmd.name
        if name == "status":
            reply({"ok": True, "health": self.health()})
        elif name in ("pause", "resume"):
            if self.pipeline is None:
                reply({"ok": False, "error": f"not serving: {self.not_serving_reason}"})
                return
            if name == "pause" and (self._operation or "").startswith(("update", "rollback")):
                # probation judges the frames the new bundle serves: a pause now would fail a good bundle
                reply({"ok": False, "busy": True, "error": f"busy: {self._operation} in progress; pause after its verdict"})
                return
            (self.pipeline.paused.set if name == "pause" else self.pipeline.paused.clear)()
            self._publish_health()
            reply({"ok": True, "paused": self.pipeline.paused.is_set()})
        elif name == "selftest":
            if self.bundle is None:
                reply({"ok": False, "error": f"no bundle loaded: {self.not_serving_reason}"})
                return
            holder = self._try_operation("selftest")
            if holder == "selftest":
                reply({"ok": False, "already_running": True, "error": "already running: a self-test is in progress"})
            elif holder is not None:
                reply({"ok": False, "busy": True, "error": f"busy: {holder} in progress; try again after it"})
            else:
                self._spawn("selftest", self._selftest_job, self.bundle, reply)
        elif name == "reload":
            self._request_reload(reply)
        elif name in ("update", "rollback"):
            self._update_command(cmd, reply)
        elif name == "snapshot":
            self._snapshot_command(cmd, reply)
        else:
            reply({"ok": False, "error": f"unknown command {name!r} (known: {', '.join(COMMANDS)})"})

    def _snapshot_command(self, cmd: Command, reply: Reply) -> None:
        """cmd/snapshot `{source?, timeout_s?}`: the next frame each asked source serves, its result drawn (the live
        view's drawing), one JPEG on `<prefix>snapshot/<source>`; the reply names the topics. Nothing is kept while
        nobody asks: the request marks the next frame wanted, and a job thread waits for it (one at a time)."""
        pipeline, view, link = self.pipeline, self.live_view, self.link
        if pipeline is None or view is None or link is None:
            reply({"ok": False, "error": f"not serving: {self.not_serving_reason}" if pipeline is None
                   else "no live view in this agent (it needs mqtt.enabled)"})
            return
        asked = cmd.payload.get("source")
        known = pipeline.view_names()
        if asked is not None and asked not in known:
            reply({"ok": False, "error": f"unknown source {asked!r} (sources: {', '.join(known)})"})
            return
        wait = cmd.payload.get("timeout_s", SNAPSHOT_WAIT_S)
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 < wait <= SNAPSHOT_WAIT_MAX_S:
            reply({"ok": False, "error": f"key timeout_s: {wait!r} is not a number of seconds in (0, "
                                          f"{SNAPSHOT_WAIT_MAX_S:g}]"})
            return
        if self._snapshot_busy:
            reply({"ok": False, "busy": True, "error": "busy: a snapshot is being taken; ask again after its reply"})
            return
        self._snapshot_busy = True
        self._spawn("snapshot", self._snapshot_job, [asked] if asked is not None else list(known), float(wait),
                    reply, release=False)

    def _snapshot_job(self, sources: list[str], wait_s: float, reply: Reply) -> None:
        from agent.link.liveview import bounded_jpeg, draw

        try:
            view, link = self.live_view, self.link
            assert view is not None and link is not None
            since = view.asked()
            deadline = time.monotonic() + wait_s
            shots, errors = [], []
            for source in sources:
                kept = view.served_since(source, since, max(0.0, deadline - time.monotonic()))
                if kept is None:
                    paused = self.pipeline is not None and self.pipeline.paused.is_set()
                    errors.append(f"source {source!r}: no frame served in {wait_s:g} s"
                                  + (" (serving is paused: send resume)" if paused else
                                     " (is the source delivering? see health/<source>)"))
                    continue
                img = draw(kept)
                data = bounded_jpeg(img)
                topic = link.topics.snapshot(source)
                if not link.publish_now(topic, data):
                    errors.append(f"source {source!r}: the MQTT link is down, the snapshot was not sent")
                    continue
                shots.append({"source": source, "topic": topic, "bytes": len(data), "seq": kept.seq,
                              "width": int(img.shape[1]), "height": int(img.shape[0])})
            log.info("snapshot.published", sources=[s["source"] for s in shots], errors=errors)
            reply({"ok": not errors, "snapshots": shots, **({"error": "; ".join(errors)} if errors else {})})
        finally:
            self._snapshot_busy = False

    def _spawn(self, name: str, fn: Callable[..., None], *args: Any, release: bool = True) -> None:
        """A job thread for an operation whose slot is already held; it releases the slot when done
        (or `fn` does, on the controller's thread, when `release` is False)."""
        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:
                if isinstance(exc, AgentError) and self.stop_event.is_set():
                    log.info("job.stopped", job=name, reason=str(exc))  # a clean stop while it ran: not an error
                else:
                    log.exception("job.failed", job=name)
            finally:
                if release:
                    self._release_operation()

        t = threading.Thread(target=run, name=f"job-{name}", daemon=True)
        self._jobs = [j for j in self._jobs if j.is_alive()] + [t]
        t.start()

    def _selftest_job(self, bundle: Bundle, reply: Reply) -> None:
        proof = prove(bundle.root, self.cfg, use_cache=False)

        def apply() -> None:
            if proof.report is not None:
                self.selftest_doc = proof.report
                self._publish_selftest()

        self.call(apply)
        doc = proof.report or {}
        reply({"ok": proof.report is not None, "passed": proof.passed, "selected": doc.get("selected"),
               "reason": proof.reason, "crashes": [c["step"] + ": " + c["signal"] for c in doc.get("crashes", [])]})

    # -- reload ------------------------------------------------------------------------------------------
    def _request_reload(self, reply: Reply | None) -> None:
        if reply is not None:
            self._reload_replies.append(reply)
        holder = self._try_operation("reload")
        if holder == "reload":
            log.info("reload.coalesced", detail="a reload is already running; this request is answered by it")
        elif holder is not None:
            self._reload_pending = True  # after the operation in progress: never interleaved with an update
            log.info("reload.deferred", behind=holder)
        else:
            self._reload_pending = False
            self.notifier.reloading()
            self._spawn("reload", self._reload_job, release=False)

    def _reload_job(self) -> None:
        try:
            new = self._read_config()
            if new is not None:
                before: _Served = self.call(lambda: self._stop_for_reload(new))
                outcome = boot(self.cfg, self.store)
                self.call(lambda: self._apply_reload(outcome, before))
        finally:
            try:
                self.call(self._reload_done)
            finally:
                self._release_operation()  # no-op when _reload_done released it already

    def _reproof_job(self) -> None:
        """A scheduled re-proof (reproof.py): the boot's proof again, applied like a boot's."""
        try:
            log.info("reproof.start", attempt=self.reproof.attempts + 1, load=round(os.getloadavg()[0], 2))
            outcome = boot(self.cfg, self.store)
            self.call(lambda: self._apply_boot(outcome) if self.engine is None else None)  # else: served meanwhile
        finally:
            try:
                self.call(self._reproof_done)
            finally:
                self._release_operation()

    def _reproof_done(self) -> None:
        self._release_operation()
        if self.reproof.armed and self.reproof.next_at is None:  # not applied (served meanwhile, or it raised)
            self.reproof.after_proof(self.selftest_doc, self.serving, self.not_serving_reason)
        if self.serving and self.engine is not None:
            log.info("reproof.serving", healed_after=self.reproof.to_dict()["healed"], **self.engine.describe())
        self.notifier.status(self._status_text())
        self._publish_health()

    def _on_drift(self, drift: dict[str, Any]) -> None:
        """The audit saw answers drift: degraded (health, STATUS, /metrics), and proven again."""
        self.notifier.status(self._status_text())
        self._publish_health()
        plan = evidence.on_drift(self, drift)  # charged to the candidate: a golden-only re-proof never clears it
        if plan == "switch" and self._try_operation("switch") is None:
            log.error("audit.reproving", how="switch", **drift)
            self._spawn("switch", evidence.switch_job, self, drift)
        elif plan in ("switch", "reload"):
            log.error("audit.reproving", how="reload", **drift)
            self._request_reload(None)
        elif plan == "selftest" and self.bundle is not None and self._try_operation("selftest") is None:
            log.error("audit.reproving", how="selftest", **drift)
            self._spawn("selftest", self._selftest_job, self.bundle,
                        lambda r: log.warning("audit.reproof_done", passed=r.get("passed"), selected=r.get("selected"),
                                              reason=r.get("reason")))

    def _read_config(self) -> Config | None:
        if self.cfg.source_file is None:
            return self.cfg
        try:
            new = load_config(self.cfg.source_file)
        except ConfigError as exc:
            log.error("reload.refused", reason=str(exc))  # keep serving what we had
            return None
        if new.mqtt != self.cfg.mqtt:
            log.warning("reload.mqtt_unchanged", detail="mqtt settings apply at the next restart")
            new = dataclasses.replace(new, mqtt=self.cfg.mqtt)
        u = self.cfg.updates
        if (new.updates.enabled, new.updates.inbox) != (u.enabled, u.inbox) or new.metrics != self.cfg.metrics:
            log.warning("reload.restart_needed", detail="updates.enabled, updates.inbox and metrics apply at the next "
                        "restart; the other updates settings (trusted_keys, limits, probation) apply now")
            new = dataclasses.replace(new, updates=dataclasses.replace(new.updates, enabled=u.enabled, inbox=u.inbox),
                                      metrics=self.cfg.metrics)
        return new

    def _stop_for_reload(self, new: Config) -> _Served:
        log.info("reload.start", config=str(new.source_file))
        before = _Served(self.cfg, self.bundle, self.engine, self.selftest_doc)
        self._use_config(new)
        self._stop_pipeline()
        self.pipeline = None
        self.engine, self.not_serving_reason = None, "reloading"
        return before

    def _use_config(self, cfg: Config) -> None:
        self.cfg = cfg
        for holder in (self.updater, self.receiver, self.downloader):  # a revoked key stops verifying now
            if holder is not None:
                holder.cfg = cfg.updates
        configure_logging(cfg.log.level, cfg.log.json)

    def _apply_reload(self, o: BootOutcome, before: _Served) -> None:
        """A reload whose proof or start fails never drops the proven engine that served before it: that engine
        serves on under the config it served with, and the refusal is said (journal, health `reload_refused`,
        the command's reply), as an update rolls back. A hash mismatch on a file altered on disk used to leave the
        device serving nothing although the proven session in memory was fine."""
        if o.engine is not None:
            self._apply_boot(o)
            if self.serving or before.engine is None:
                self.reload_refused = None
                return
            why = self.not_serving_reason or "the new engine did not start"
        elif before.engine is None:
            self._apply_boot(o)  # nothing proven served before: the reload's verdict is the state
            return
        else:
            why = o.reason or "no candidate passed"
        self._use_config(before.cfg)
        # a source the reloaded config named that cannot open is this reload's refusal, not a reason to exit
        self.config_refused = None
        self.bundle, self.engine, self.selftest_doc, self.not_serving_reason = (before.bundle, before.engine,
                                                                                before.doc, None)
        try:
            self._start_pipeline()
        except AgentError as exc:  # the source it served from is gone too: nothing serves, saying both
            self.engine, self.not_serving_reason = None, f"{why}; and the previous engine could not restart: {exc}"
            log.error("boot.not_serving", reason=self.not_serving_reason)
            return
        self.reload_refused = {"reason": why, "ts": round(time.time(), 3), "serving": before.engine.candidate.key}
        log.error("reload.refused", reason=why, kept=before.engine.candidate.key,
                  detail="the proven engine that served before the reload serves on; fix the cause and reload again")
        self._publish_selftest()

    def _reload_done(self) -> None:
        # Released here, on the controller's thread: a reload request handled after this line starts a
        # new reload instead of joining one whose answers were already sent.
        self._release_operation()
        self.notifier.ready(self._status_text())
        self._publish_health()
        replies, self._reload_replies = self._reload_replies, []
        refused = self.reload_refused["reason"] if self.reload_refused else None
        for reply in replies:
            reply({"ok": self.not_serving_reason is None and refused is None, "serving": self.serving,
                   "reason": self.not_serving_reason or (refused and f"reload refused, the previous engine serves: "
                                                                     f"{refused}"),
                   "config": str(self.cfg.source_file)})

    # -- updates by command --------------------------------------------------------------------------------
    def _update_command(self, cmd: Command, reply: Reply) -> None:
        """On the controller's thread: the update machine takes the command or answers busy at once; the
        work runs on a job thread. The machine's state is the only "one at a time" guard."""
        updater, downloader = self.updater, self.downloader
        if updater is None or downloader is None:
            reply({"ok": False, "error": "updates are not enabled (updates.enabled)"})
            return
        if cmd.name == "update":
            url, sha = cmd.payload.get("url"), cmd.payload.get("sha256")
            if not isinstance(url, str) or not isinstance(sha, str):
                reply({"ok": False, "error": "update needs {\"url\": \"http(s)://...\", \"sha256\": \"...\"}"})
                return
            uid = str(cmd.payload.get("id", url.rsplit("/", 1)[-1]))[:100]
            snap, store = updater.machine.snapshot, self.store
            if (snap.update == uid and snap.state is State.COMMITTED and self._url_committed == (uid, sha)
                    and store is not None and snap.bundle is not None
                    and store.current_id == snap.bundle == store.committed_id):
                # the same update again (same id and sha256; a fleet operator resumed after its first
                # command went out), its bundle still the one serving: its verdict, not a second install
                reply({"ok": True, "repeated": True,
                       "update": self._last_update if (self._last_update or {}).get("update") == uid
                       else {"update": uid, "state": "committed"}})
                return
            refused = downloader.refusal(url, uid)
            if refused is not None:
                reply({"ok": False, "update": refused})
                return
            busy = updater.begin(uid, "url")
            cancel = updater.machine.cancel  # this download's: a newer start hands out another
            work: Callable[[], dict[str, Any]] = lambda: downloader.fetch_started(url, sha, uid, cancel)  # noqa: E731
        else:
            uid = str(cmd.payload.get("id", "rollback"))[:100]
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

        self._update_thread = threading.Thread(target=run, name=f"job-{cmd.name}", daemon=True)
        self._update_thread.start()

    # -- start -----------------------------------------------------------------------------------------
    def _start_updates(self) -> None:
        """Before MQTT starts: bundle messages the broker kept for us arrive on connect and need a receiver."""
        if not self.cfg.updates.enabled:
            return
        from agent.updates.delivery import ChunkReceiver, Downloader
        from agent.updates.store import BundleStore
        from agent.updates.updater import Updater

        self.store = BundleStore(self.cfg.state_dir / "store")
        self.store.recover()  # only here, before anything can stage: a reload never touches staging
        # the proof of an update runs under the config object that serves (self.cfg, after any reload)
        self.updater = Updater(self, self.store, self.cfg.updates, self.cfg.state_dir, lambda: self.cfg,
                               self._publish_update, on_owner=self.on_controller)
        # a power cut mid-update: its verdict, published (committed when the store's commit was reached)
        cut = self.updater.machine.resolve_interrupted(committed=self.store.committed_id)
        if cut is not None:
            self._last_update = {"update": cut.update, "origin": cut.origin, "state": cut.state.value,
                                 "ts": round(cut.since, 3), "phase": cut.state.value, "reason": cut.reason}
        self.receiver, self.downloader = ChunkReceiver(self.updater), Downloader(self.updater)
        threading.Thread(target=self.receiver.run_sweeper, args=(self.stop_event,), name="sweeper", daemon=True).start()

    def _start_mqtt(self) -> None:
        if not self.cfg.mqtt.enabled:
            return
        from agent.link.mqtt import MqttLink
        from agent.link.outbox import Outbox

        import sqlite3  # the outbox's, imported with it

        try:
            self.outbox = Outbox(self.cfg.state_dir / "outbox.sqlite", self.cfg.outbox)
        except (OSError, sqlite3.OperationalError) as exc:
            # a state disk full at boot (SQLite cannot even start its journal): the results go through an
            # outbox in memory, as they do when the disk fills later; a backlog on the disk waits for a restart
            # with space. Exiting here left the device down and silent.
            if "full" not in str(exc) and getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT):
                raise
            spare_dir = memory_dir(self.cfg.state_dir)
            log.error("outbox.state_disk_full", file=str(self.cfg.state_dir / "outbox.sqlite"), error=str(exc),
                      instead=str(spare_dir / "outbox.sqlite"),
                      reason="disk full: results are kept in memory until the broker takes them")
            self.outbox = Outbox(spare_dir / "outbox.sqlite", self.cfg.outbox)
        self.link = MqttLink(self.cfg.mqtt, self.cfg.device_id, self.cfg.state_dir, self.outbox,
                             self.command_inlet(), self._retained,
                             on_bundle=self.on_bundle_message if self.cfg.updates.enabled else None,
                             instance=self.instance)
        self.link.start()

    def _start_inbox(self) -> None:
        if self.updater is not None and self.cfg.updates.inbox is not None:
            from agent.updates.delivery import watch_inbox

            threading.Thread(target=watch_inbox, args=(self.updater, self.stop_event), name="inbox",
                             daemon=True).start()

    # -- main loop -------------------------------------------------------------------------------------
    def run(self) -> int:
        """Boot, serve until stopped; 0 on a clean stop or a finite source's end, non-zero on a dead stage."""
        self._thread = threading.current_thread()
        forbid_fd_capture()  # native output is captured only in the self-test child
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        # results carry (boot, seq): unique across restarts, so a subscriber can prove nothing was lost
        self.boot_number = bump_counter(self.cfg.state_dir / "boots")
        self._start_updates()
        self._start_mqtt()  # a broker that is down never delays boot: the link connects in the background
        from agent.link.prometheus import start_metrics_server

        served_live = bool(self.cfg.metrics.listen and self.cfg.metrics.live_view)
        if served_live or self.link is not None:  # MQTT: cmd/snapshot draws with it (nothing kept until asked)
            from agent.link.liveview import LiveView

            self.live_view = LiveView(self.health_snapshot)
        self.metrics_server = start_metrics_server(self.cfg.metrics.listen, self,
                                                   self.live_view if served_live else None)  # None unless set
        # The boot's proof runs on a job thread like any operation: the controller answers commands and
        # takes bundle messages meanwhile; an update that arrives now waits for the slot.
        self._try_operation("boot")
        self._spawn("boot", self._boot_job, release=False)
        self.auditor.start()
        code = self._loop()
        self._shutdown()
        return code

    def _boot_job(self) -> None:
        try:
            # while the proof runs in its child, the decoder binding the first frame needs is imported here
            warm = threading.Thread(target=warm_decoder, args=(self.cfg.source_list,), name="warm-decoder",
                                    daemon=True)
            warm.start()
            # a source `run` can never open is refused before a proof that would take minutes (config check's line)
            bad = source_problems(self.cfg)
            outcome = BootOutcome(None, None, None, bad[0], refused=True) if bad else boot(self.cfg, self.store)
            warm.join(timeout=30)  # done long before, normally; the source would wait for it anyway
            spare.discard()  # the boot's proof adopted it, or never will: it would only hold memory
            self.call(lambda: self._boot_done(outcome))
        finally:
            self._release_operation()  # no-op when _boot_done released it already

    def _boot_done(self, outcome: BootOutcome) -> None:
        self._apply_boot(outcome)
        self._release_operation()
        self._start_inbox()
        # Ready means proven: a candidate passed, or the agent settled in "not serving" and says why.
        self.notifier.ready(self._status_text())
        self._publish_health()

    def _loop(self) -> int:
        next_ping = 0.0
        interval = self.cfg.output.health_interval_s
        next_health = time.monotonic() + interval
        while not self.stop_event.is_set():
            try:
                self._handle(self.events.get(timeout=0.1))
                for _ in range(EVENT_QUEUE_SIZE):  # what else waits, without sleeping between
                    self._handle(self.events.get_nowait())
            except queue.Empty:
                pass
            self._probation_tick()
            if self._reload_signal.is_set():
                self._reload_signal.clear()
                self._request_reload(None)
            if self._reload_pending and self._operation is None:
                self._request_reload(None)
            if self.config_refused is not None:
                log.error("boot.config_refused", reason=self.config_refused, exit_code=EXIT_PIPELINE_FAILED)
                return EXIT_PIPELINE_FAILED
            drift = self.auditor.take_drift()
            if drift is not None:
                self._on_drift(drift)
            if self.reproof.due() and self._try_operation("reproof") is None:
                self.reproof.started()
                self._spawn("reproof", self._reproof_job, release=False)
            p = self.pipeline
            if p is not None and p.failed is not None:
                self.not_serving_reason = p.failed
                self.notifier.status(f"NOT serving: {p.failed}")
                doc = self._publish_health()
                log.error("pipeline.failed", reason=p.failed, exit_code=EXIT_PIPELINE_FAILED,
                          **{k: doc["pipeline"][k] for k in ("frames_in", "frames_out")})
                return EXIT_PIPELINE_FAILED  # the watchdog is never fed again; systemd restarts us
            if (p is not None and p.done.is_set() and (not self.cfg.mqtt.enabled or self.cfg.pipeline.max_frames)
                    and self._operation is None and not self._reload_pending):
                return 0  # a finite source ended and nothing else can reach us, or --max-frames was reached
            if self.notifier.watchdog_s and time.monotonic() >= next_ping:
                self._watchdog()
                next_ping = time.monotonic() + self.notifier.watchdog_s / 4
            key = self._health_key()
            if time.monotonic() >= next_health or key != self._last_health_key:
                doc = self._publish_health()
                if key != self._last_health_key:
                    self.notifier.status(self._status_text())
                    self._journal_loud()
                self._last_health_key = key
                log.info("health", **{k: doc[k] for k in ("serving", "not_serving_reason", "paused", "variant")},
                         **({"reproof": doc["reproof"]} if doc["reproof"]["armed"] else {}),
                         # the stage plan is logged once, as pipeline.stages_sized: not on every health line
                         **{k: v for k, v in (doc["pipeline"] or {}).items() if k not in ("latency_ms", "stages")},
                         decoder=(doc["source"] or {}).get("decoder"),
                         **sources_summary(doc))
                next_health = time.monotonic() + interval
        return 0

    def _shutdown(self) -> None:
        self.notifier.stopping()
        self.auditor.stop()
        self._stop_pipeline()
        # An update may be waiting on `call` to restore what it switched: keep answering until it is done
        # (bounded). A self-test child (boot, reload, command) is simply abandoned: it dies with us.
        if self.updater is not None:
            self.updater.machine.cancel.set()  # a download in flight stops now, not at its deadline
        deadline = time.monotonic() + 30
        while ((self._operation or "").startswith(("update", "rollback")) or
               (self._update_thread is not None and self._update_thread.is_alive())) and time.monotonic() < deadline:
            self._probation_tick()  # a shutdown ends a probation at once (cut short: not committed)
            try:
                self._handle(self.events.get(timeout=0.1))
            except queue.Empty:
                pass
        self._loop_done.set()
        while True:  # update statuses posted before the loop ended still count (the last word of an update)
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, UpdateStatus):
                self._apply_update_status(ev.doc)
        doc = self.health()
        p = doc["pipeline"] or {}
        log.info("shutdown", serving=doc["serving"], **{k: v for k, v in p.items() if k != "latency_ms"},
                 decoder=(doc["source"] or {}).get("decoder"), **sources_summary(doc))
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
            for name, one in (doc.get("sources") or {}).items():
                self.link.publish_retained(self.link.topics.source_health(name),
                                           json.dumps({"ts": doc["ts"], "source": name, **one}).encode())
            self.link.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()


class CommandInlet:
    """What the MQTT link calls for a command, on its network thread: post and return at once.

    The controller replies through the link when it has the answer; a full queue is answered "busy"
    here, so no thread is ever started per command."""

    replies_later = True

    def __init__(self, controller: Controller):
        self.controller = controller

    def __call__(self, cmd: Command) -> dict[str, Any] | None:
        c = self.controller

        def reply(result: dict[str, Any]) -> None:
            if c.link is not None:  # commands arrive only through the link
                c.link.reply(cmd, result)

        if not c.post(CommandEvent(cmd, reply)):
            return {"ok": False, "busy": True, "error": f"busy: {EVENT_QUEUE_SIZE} requests are waiting; try again"}
        return None
