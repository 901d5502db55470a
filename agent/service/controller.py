"""The controller: one thread owns the agent's state and everything else posts events to it.

It wires the components and runs the loop; each component owns its own state:
`served` (bundle, engine, pipeline, proof report), `status` (health and the retained documents),
`commands`, `reloads` (reload, re-proof, drift), `updates` (the updater's host) and `slot` (the one
operation slot and its job threads). MQTT callbacks, signals, commands, the inbox and timers reach the
controller through one bounded queue (full: "busy", never a new thread). Slow work (a self-test child, a
reload's proof, an update) runs on one job thread at a time that holds the operation slot, and changes
state only through `call`, which runs on the controller's thread. Reload, self-test and update are
operations, so they never interleave; a second request of the same kind while one runs is answered
"already running".
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from agent.config import Config
from agent.fsio import bump_counter
from agent.link.health import ProcessProbe
from agent.logsetup import get_logger
from agent.proof import spare
from agent.proof.session import forbid_fd_capture
from agent.serving.pipeline import Sink
from agent.serving.sources import warm_decoder
from agent.service.audit import Auditor, AuditSettings
from agent.service.boot import BootOutcome, boot
from agent.service.links import start_mqtt, start_observers
from agent.service.commands import COMMANDS, CommandInlet, Commands
from agent.service.events import EVENT_QUEUE_SIZE, BundleMessage, Call, CommandEvent, Mailbox, UpdateStatus
from agent.service.operations import MAX_OPERATION_CHARS, OperationSlot, _bounded_name
from agent.service.preflight import source_problems
from agent.service.reloads import Reloads
from agent.service.reproof import Reproof, ReproofSchedule
from agent.service.sdnotify import Notifier
from agent.service.served import Served, proven_decode
from agent.service.status import StatusBoard, sources_summary
from agent.service.update_host import UpdateHost

if TYPE_CHECKING:  # imported at run time only when MQTT or metrics are enabled (_start_*)
    from agent.link.mqtt import MqttLink
    from agent.link.outbox import Outbox
    from agent.link.prometheus import MetricsServer

# names older callers and tests import from here
__all__ = ["COMMANDS", "EVENT_QUEUE_SIZE", "MAX_OPERATION_CHARS", "CommandInlet", "Controller", "_bounded_name",
           "proven_decode", "sources_summary"]

log = get_logger("controller")

EXIT_PIPELINE_FAILED = 1  # a dead stage: exit non-zero so systemd (Restart=on-failure) restarts us


class Controller:
    """Wires the components and runs `run()` on the main thread."""

    def __init__(self, cfg: Config, sink: Sink | None = None):
        self.cfg = cfg
        self.extra_sink = sink
        self.mailbox = Mailbox()
        self.events, self.loop_done = self.mailbox.events, self.mailbox.loop_done
        self.on_own_thread, self.on_controller = self.mailbox.on_own_thread, self.mailbox.on_controller
        self.stop_event = threading.Event()
        self._reload_signal = threading.Event()
        self.started = time.monotonic()
        self.boot_number = 0
        # this agent process, drawn at start: in availability, health and every result, so two live agents
        # under one device_id (a cloned card: the same state dir, the same boot counter) stay distinguishable
        self.instance = uuid.uuid4().hex[:12]
        self.probe = ProcessProbe()
        self.notifier = Notifier()
        self.link: MqttLink | None = None
        self.outbox: Outbox | None = None
        self.metrics_server: MetricsServer | None = None
        self.live_view: Any = None  # agent.link.liveview.LiveView with metrics.live_view or MQTT (cmd/snapshot)
        self.slot = OperationSlot(self.stop_event)
        self.served = Served(self)
        self.status = StatusBoard(self)
        self.commands = Commands(self)
        self.reloads = Reloads(self)
        self.updates = UpdateHost(self)
        sel = cfg.selection  # re-proof while up when nothing serves only because of latency (reproof.py)
        self.reproof = Reproof(ReproofSchedule(sel.reproof_backoff_s, sel.reproof_max_backoff_s))
        # keep proving while serving (audit.py): canary and live audit on their own thread
        self.auditor = Auditor(AuditSettings.from_config(cfg),
                               lambda: self.served.engine if self.served.serving else None, cfg.session)
        self.auditor.latency_histogram = lambda: (self.served.pipeline.metrics.histograms_ms["inference"]
                                                  if self.served.pipeline else None)  # slowness.py

    # -- any thread: the mailbox's ----------------------------------------------------------------------
    def post(self, event: Any, timeout: float | None = None) -> bool:
        return self.mailbox.post(event, timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.mailbox.call(fn)

    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()

    def request_reload(self, *_: Any) -> None:
        self._reload_signal.set()

    def command_inlet(self) -> CommandInlet:
        return CommandInlet(self)

    def on_bundle_message(self, topic: str, payload: bytes) -> None:
        """paho's thread: a bundle transfer message. Waits a moment for room (back-pressure on the broker)."""
        if not self.post(BundleMessage(topic, payload), timeout=5):
            log.error("bundle.message_dropped", topic=topic, reason="controller queue full for 5 s")

    def health_snapshot(self) -> dict[str, Any]:
        """/metrics, on its HTTP thread: the health document last published."""
        return self.status.snapshot()

    def health(self) -> dict[str, Any]:
        return self.status.health()

    def pipeline_metrics(self) -> Any:
        """The live pipeline's histograms for /metrics (None while nothing serves)."""
        p = self.served.pipeline
        return p.metrics if p is not None else None

    @property
    def serving(self) -> bool:
        return self.served.serving

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
                self.commands.handle(ev.cmd, ev.reply)
            except Exception as exc:  # a failing command is an error reply, never a dead controller
                log.exception("command.failed", command=ev.cmd.name)
                ev.reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        elif isinstance(ev, BundleMessage):
            self.updates.on_bundle_message(ev.topic, ev.payload)
        elif isinstance(ev, UpdateStatus):
            self.status.apply_update_status(ev.doc)

    # -- main loop -------------------------------------------------------------------------------------
    def run(self) -> int:
        """Boot, serve until stopped; 0 on a clean stop or a finite source's end, non-zero on a dead stage."""
        self.mailbox.owner = threading.current_thread()
        forbid_fd_capture()  # native output is captured only in the self-test child
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        # results carry (boot, seq): unique across restarts, so a subscriber can prove nothing was lost
        self.boot_number = bump_counter(self.cfg.state_dir / "boots")
        self.updates.start()
        start_mqtt(self)  # a broker that is down never delays boot: the link connects in the background
        start_observers(self)
        # The boot's proof runs on a job thread like any operation: the controller answers commands and
        # takes bundle messages meanwhile; an update that arrives now waits for the slot.
        self.slot.try_take("boot")
        self.slot.spawn("boot", self._boot_job, release=False)
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
            outcome = BootOutcome(None, None, None, bad[0], refused=True) if bad else boot(self.cfg, self.updates.store)
            warm.join(timeout=30)  # done long before, normally; the source would wait for it anyway
            spare.discard()  # the boot's proof adopted it, or never will: it would only hold memory
            self.call(lambda: self._boot_done(outcome))
        finally:
            self.slot.release()  # no-op when _boot_done released it already

    def _boot_done(self, outcome: BootOutcome) -> None:
        self.served.apply_boot(outcome)
        self.slot.release()
        self.updates.start_inbox()
        # Ready means proven: a candidate passed, or the agent settled in "not serving" and says why.
        self.notifier.ready(self.status.status_text())
        self.status.publish_health()

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
            code = self._step()
            if code is not None:
                return code
            if self.notifier.watchdog_s and time.monotonic() >= next_ping:
                self.status.watchdog()
                next_ping = time.monotonic() + self.notifier.watchdog_s / 4
            if self.status.tick(force=time.monotonic() >= next_health):
                next_health = time.monotonic() + interval
        return 0

    def _step(self) -> int | None:
        """One turn of the loop's checks; an exit code when the agent must stop."""
        self.updates.probation_tick()
        if self._reload_signal.is_set():
            self._reload_signal.clear()
            self.reloads.request(None)
        if self.reloads.pending and self.slot.name is None:
            self.reloads.request(None)
        s = self.served
        if s.config_refused is not None:
            log.error("boot.config_refused", reason=s.config_refused, exit_code=EXIT_PIPELINE_FAILED)
            return EXIT_PIPELINE_FAILED
        drift = self.auditor.take_drift()
        if drift is not None:
            self.reloads.on_drift(drift)
        self.reloads.start_reproof_if_due()
        p = s.pipeline
        if p is not None and p.failed is not None:
            s.reason = p.failed
            self.notifier.status(f"NOT serving: {p.failed}")
            doc = self.status.publish_health()
            log.error("pipeline.failed", reason=p.failed, exit_code=EXIT_PIPELINE_FAILED,
                      **{k: doc["pipeline"][k] for k in ("frames_in", "frames_out")})
            return EXIT_PIPELINE_FAILED  # the watchdog is never fed again; systemd restarts us
        if (p is not None and p.done.is_set() and (not self.cfg.mqtt.enabled or self.cfg.pipeline.max_frames)
                and self.slot.name is None and not self.reloads.pending):
            return 0  # a finite source ended and nothing else can reach us, or --max-frames was reached
        return None

    def _shutdown(self) -> None:
        self.notifier.stopping()
        self.auditor.stop()
        self.served.stop_pipeline()
        # An update may be waiting on `call` to restore what it switched: keep answering until it is done
        # (bounded). A self-test child (boot, reload, command) is simply abandoned: it dies with us.
        if self.updates.updater is not None:
            self.updates.updater.machine.cancel.set()  # a download in flight stops now, not at its deadline
        deadline = time.monotonic() + 30
        while self.updates.in_flight() and time.monotonic() < deadline:
            self.updates.probation_tick()  # a shutdown ends a probation at once (cut short: not committed)
            try:
                self._handle(self.events.get(timeout=0.1))
            except queue.Empty:
                pass
        self.loop_done.set()
        while True:  # update statuses posted before the loop ended still count (the last word of an update)
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, UpdateStatus):
                self.status.apply_update_status(ev.doc)
        doc = self.status.health()
        p = doc["pipeline"] or {}
        log.info("shutdown", serving=doc["serving"], **{k: v for k, v in p.items() if k != "latency_ms"},
                 decoder=(doc["source"] or {}).get("decoder"), **sources_summary(doc))
        if self.link is not None:
            self.status.publish_health(doc)
            self.link.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
