"""The agent's boot sequence and main loop: config -> bundle -> self-test -> engine -> pipeline -> serve,
with MQTT (availability, health, self-test, predictions through the outbox, commands) when enabled.

Nothing is served from an unproven setup: when the self-test selects nothing (or the bundle does not
load), the agent stays up, not serving, and says why, so a new bundle or command can still reach it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from agent.bundle.load import Bundle, load_bundle
from agent.config import Config, SourceConfig, load_config
from agent.serving.engine import Engine, build_engine
from agent.errors import AgentError, ConfigError
from agent.fsio import bump_counter
from agent.link.health import ProcessProbe, build_health
from agent.logsetup import configure_logging, get_logger
from agent.serving.pipeline import Pipeline, Sink
from agent.service.sdnotify import Notifier
from agent.proof.selftest import options_from_config, run_selftest
from agent.serving.sinks import FanOutSink, JsonLinesSink, NullSink, OutboxSink
from agent.serving.sources import is_lossless, open_source

log = get_logger("daemon")

DEMO_BUNDLE = Path("models/digits-classifier")
DEMO_FRAMES = Path("models/demo-frames/digits")
COMMANDS = ("status", "selftest", "reload", "pause", "resume", "update", "rollback")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edge-agent"


def demo_config() -> Config:
    """The config `edge-agent run` uses without --config: the demo bundle on the demo frames."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / DEMO_BUNDLE / "bundle.yaml").exists() and (root / DEMO_FRAMES).is_dir():
            return Config(
                state_dir=default_state_dir(),
                bundle=root / DEMO_BUNDLE,
                source=SourceConfig(type="folder", path=root / DEMO_FRAMES),
            )
    raise ConfigError(
        f"no --config given and no demo found ({DEMO_BUNDLE} and {DEMO_FRAMES}): "
        "run from the repository root or pass --config FILE"
    )


class Agent:
    """Owns the serving state; the shell around the pure parts."""

    def __init__(self, cfg: Config, sink: Sink | None = None):
        self.cfg = cfg
        self.extra_sink = sink
        self.stop_event = threading.Event()
        self.reload_event = threading.Event()
        self.lock = threading.RLock()  # boot/reload vs commands
        self.bundle: Bundle | None = None
        self.selftest_doc: dict[str, Any] | None = None  # the report that proved what serves now
        self.store = None
        self.updater = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.not_serving_reason: str | None = None
        self.started = time.monotonic()
        self.probe = ProcessProbe()
        self.link = None
        self.outbox = None
        self._last_health_key: Any = None
        self._reload_waiters: list[threading.Event] = []
        self._last_update: dict[str, Any] | None = None
        self.boot_number = 0
        self.notifier = Notifier()

    # -- boot --------------------------------------------------------------------------------------------
    def boot(self) -> bool:
        """Load and prove the bundle; True when an engine is ready to serve."""
        cfg = self.cfg
        self.engine = None
        try:
            self.bundle = self._serving_bundle()
            if self.bundle is None:
                return self._not_serving("no bundle configured (key bundle) and none in the store")
            report = run_selftest(self.bundle, cfg.state_dir, options_from_config(cfg))
            self.selftest_doc = report.to_dict()
        except AgentError as exc:
            return self._not_serving(str(exc))
        finally:
            self._publish_selftest()
        sel = report.selected
        if sel is None:
            return self._not_serving(report.reason or "no candidate passed")
        try:
            self.engine = self._engine_for(self.bundle, sel.candidate)
        except AgentError as exc:
            return self._not_serving(str(exc))
        self.not_serving_reason = None
        log.info("boot.ready", **self.engine.describe())
        return True

    def _serving_bundle(self) -> Bundle | None:
        """With updates: the store's committed bundle (seeded from `bundle` once); else `bundle` itself."""
        cfg = self.cfg
        if not cfg.updates.enabled:
            return load_bundle(cfg.bundle) if cfg.bundle is not None else None
        from agent.updates.store import BundleStore

        self.store = self.store or BundleStore(cfg.state_dir / "store")
        self.store.recover()
        found = self.store.load_serving()
        if found is None and cfg.bundle is not None:
            bid = self.store.import_bundle(cfg.bundle)
            log.info("store.seeded", bundle=bid, source=str(cfg.bundle))
            found = self.store.load_serving()
        return found[0] if found else None

    def _engine_for(self, bundle: Bundle, candidate: Any) -> Engine:
        engine = build_engine(bundle, candidate, self.cfg.session)
        if candidate.provider not in engine.opened.effective:
            raise AgentError(f"the serving session for {candidate.key} runs on {list(engine.opened.effective)}, "
                             "not the proven provider")
        return engine

    # -- updates (called by agent.updates.Updater) ------------------------------------------------------------
    def swap_bundle(self, bundle: Bundle, candidate: Any, report: dict[str, Any]) -> Any:
        """Serve `bundle` now; returns what `restore` needs to go back."""
        engine = self._engine_for(bundle, candidate)
        previous = (self.bundle, self.engine, self.selftest_doc, self.not_serving_reason)
        with self.lock:
            self.bundle, self.engine, self.selftest_doc, self.not_serving_reason = bundle, engine, report, None
            if self.serving:
                self.pipeline.swap_engine(engine)
            else:
                self.start_pipeline()
        self._publish_selftest()
        return previous

    def restore(self, previous: Any) -> None:
        with self.lock:
            self.bundle, self.engine, self.selftest_doc, self.not_serving_reason = previous
            if self.engine is not None and self.serving:
                self.pipeline.swap_engine(self.engine)
            elif self.engine is None:
                self.stop_pipeline()
                self.pipeline = None
        self._publish_selftest()

    def pipeline_metrics(self) -> Any:
        return self.pipeline.metrics if self.serving else None

    def _not_serving(self, reason: str) -> bool:
        self.not_serving_reason = reason
        log.error("boot.not_serving", reason=reason)
        return False

    # -- serve -------------------------------------------------------------------------------------------
    def _sink(self) -> Sink:
        sinks: list[Any] = []
        if self.cfg.output.stdout:
            sinks.append(JsonLinesSink())
        if self.outbox is not None and self.link is not None:
            sinks.append(OutboxSink(self.outbox, self.link.topics.predictions, self.cfg.mqtt.qos,
                                    self.cfg.mqtt.batch_predictions))
        if self.extra_sink is not None:
            sinks.append(self.extra_sink)
        return FanOutSink(*sinks) if sinks else NullSink()

    def start_pipeline(self) -> Pipeline:
        assert self.engine is not None and self.bundle is not None
        source = open_source(self.cfg.source, self.bundle.manifest.frame)
        self.pipeline = Pipeline(source, self.engine, self._sink(), self.cfg.pipeline,
                                 is_lossless(self.cfg.source, source), boot=self.boot_number)
        self.pipeline.max_result_bytes = self.cfg.output.max_result_bytes
        log.info("pipeline.start", source=source.name, lossless=self.pipeline.lossless)
        return self.pipeline.start()

    def stop_pipeline(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline.join(timeout=30)
            self.pipeline.source.close()

    @property
    def serving(self) -> bool:
        return self.pipeline is not None and not self.pipeline.done.is_set()

    # -- health --------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        p = self.pipeline
        status = p.status() if p is not None else None
        source = None
        if p is not None:
            st = p.source.stats
            source = {"name": p.source.name, "state": st.state, "last_frame_age_s": status.last_frame_age_s,
                      "frames": st.frames, "bad": st.bad, "reconnects": st.reconnects, "losses": st.losses,
                      "frozen_events": st.frozen_events}
        return build_health(
            device_id=self.cfg.device_id,
            uptime_s=time.monotonic() - self.started,
            session=self.link.session if self.link else 0,
            interval_s=self.cfg.output.health_interval_s,
            serving=self.serving,
            not_serving_reason=self.not_serving_reason,
            engine=self.engine.describe() if self.engine else None,
            placement=dict(self.engine.opened.placement.nodes_by_provider) if self.engine else None,
            selftest=self.selftest_doc,  # health_selftest(): the figures /metrics and the report page show
            pipeline=status.metrics if status else None,
            source=source,
            outbox=self.outbox.stats() if self.outbox is not None else None,
            process=self.probe.sample(),
            paused=bool(p and p.paused.is_set()),
            mqtt_connected=self.link.connected.is_set() if self.link is not None else None,
            update=self._last_update,
        )

    def publish_health(self) -> dict[str, Any]:
        doc = self.health()
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
        return doc

    def _health_key(self) -> Any:
        """What counts as a change worth publishing at once."""
        p = self.pipeline
        return (self.serving, self.not_serving_reason, self.engine.describe()["variant"] if self.engine else None,
                p.source.stats.state if p else None, bool(p and p.paused.is_set()))

    def _publish_selftest(self) -> None:
        if self.link is not None and self.selftest_doc is not None:
            self.link.publish_retained(self.link.topics.selftest, json.dumps(self.selftest_doc).encode())

    def _retained(self) -> dict[str, bytes]:
        assert self.link is not None
        out = {self.link.topics.health: json.dumps(self.health()).encode()}
        if self.selftest_doc is not None:
            out[self.link.topics.selftest] = json.dumps(self.selftest_doc).encode()
        if self._last_update is not None:
            out[self.link.topics.update_status] = json.dumps(self._last_update).encode()
        if self.cfg.mqtt.homeassistant:
            from agent.link.discovery import discovery_messages

            out.update(discovery_messages(self.cfg, self.link.topics))
        return out

    # -- commands ------------------------------------------------------------------------------------------
    def handle_command(self, cmd: Any) -> dict[str, Any]:
        if cmd.name == "status":
            return {"ok": True, "health": self.health()}
        if cmd.name == "pause" or cmd.name == "resume":
            if self.pipeline is None:
                return {"ok": False, "error": f"not serving: {self.not_serving_reason}"}
            (self.pipeline.paused.set if cmd.name == "pause" else self.pipeline.paused.clear)()
            self.publish_health()
            return {"ok": True, "paused": self.pipeline.paused.is_set()}
        if cmd.name == "selftest":
            if self.bundle is None:
                return {"ok": False, "error": f"no bundle loaded: {self.not_serving_reason}"}
            with self.lock:
                report = run_selftest(self.bundle, self.cfg.state_dir,
                                      dataclasses.replace(options_from_config(self.cfg), use_cache=False))
                doc = self.selftest_doc = report.to_dict()
            self._publish_selftest()
            return {"ok": True, "passed": doc["passed"], "selected": doc["selected"], "reason": doc["reason"]}
        if cmd.name == "reload":
            done = threading.Event()
            self._reload_waiters.append(done)
            self.reload_event.set()
            done.wait(timeout=120)
            return {"ok": self.not_serving_reason is None, "serving": self.serving,
                    "reason": self.not_serving_reason, "config": str(self.cfg.source_file)}
        if cmd.name in ("update", "rollback"):
            if self.updater is None:
                return {"ok": False, "error": "updates are not enabled (updates.enabled)"}
            if cmd.name == "rollback":
                result = self.updater.rollback(str(cmd.payload.get("id", "rollback")))
            else:
                url, sha = cmd.payload.get("url"), cmd.payload.get("sha256")
                if not isinstance(url, str) or not isinstance(sha, str):
                    return {"ok": False, "error": "update needs {\"url\": \"http(s)://...\", \"sha256\": \"...\"}"}
                result = self.downloader.fetch(url, sha, str(cmd.payload.get("id", url.rsplit("/", 1)[-1])))
            return {"ok": result["state"] == "committed", "update": result}
        return {"ok": False, "error": f"unknown command {cmd.name!r} (known: {', '.join(COMMANDS)})"}

    def reload(self) -> None:
        """Re-read the config file and boot again (the systemd RELOADING path and the reload command)."""
        with self.lock:
            if self.cfg.source_file is not None:
                try:
                    new = load_config(self.cfg.source_file)
                except ConfigError as exc:
                    log.error("reload.refused", reason=str(exc))  # keep serving what we had
                    return
                if new.mqtt != self.cfg.mqtt:
                    log.warning("reload.mqtt_unchanged", detail="mqtt settings apply at the next restart")
                    new = dataclasses.replace(new, mqtt=self.cfg.mqtt)
                self.cfg = new
                configure_logging(new.log.level, new.log.json)
            log.info("reload.start", config=str(self.cfg.source_file))
            self.stop_pipeline()
            self.pipeline = None
            if self.boot():
                self.start_pipeline()
        self.publish_health()

    # -- main loop -------------------------------------------------------------------------------------------
    def status_line(self) -> str:
        """systemd's STATUS=: what serves, or why nothing does."""
        if self.engine is not None and self.not_serving_reason is None:
            d = self.engine.describe()
            return f"serving {d['bundle']} v{d['version']} {d['variant']} on {d['provider']}"
        return f"NOT serving: {self.not_serving_reason}"

    def _watchdog(self) -> None:
        """Ping only while frames really flow (or while not serving by design): a hung pipeline misses it."""
        reason = None
        if self.serving and self.notifier.watchdog_s:
            reason = self.pipeline.stalled(horizon_s=max(self.notifier.watchdog_s / 2, 1.0))
        if reason is None:
            self.notifier.watchdog()
        else:
            log.error("watchdog.withheld", reason=reason)
            self.notifier.status(f"STALLED: {reason}")

    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()
        if self.pipeline is not None:
            self.pipeline.stop()

    def request_reload(self, *_: Any) -> None:
        self.reload_event.set()

    def start_mqtt(self) -> None:
        if not self.cfg.mqtt.enabled:
            return
        from agent.link.mqtt import MqttLink
        from agent.link.outbox import Outbox

        self.outbox = Outbox(self.cfg.state_dir / "outbox.sqlite", self.cfg.outbox)
        self.link = MqttLink(self.cfg.mqtt, self.cfg.device_id, self.cfg.state_dir, self.outbox,
                             self.handle_command, self._retained,
                             on_bundle=self._on_bundle_message if self.cfg.updates.enabled else None)
        self.link.start()  # after the assignment: on_connect may run before start() returns

    def _publish_update(self, doc: dict[str, Any]) -> None:
        self._last_update = doc
        if self.link is not None:
            self.link.publish_retained(self.link.topics.update_status, json.dumps(doc).encode())

    def start_updates(self) -> None:
        if not self.cfg.updates.enabled:
            return
        from agent.updates.store import BundleStore
        from agent.updates.delivery import ChunkReceiver, Downloader, watch_inbox
        from agent.updates.updater import Updater

        self.store = self.store or BundleStore(self.cfg.state_dir / "store")
        self.updater = Updater(self, self.store, self.cfg.updates, self.cfg.state_dir, self.cfg.source_file,
                               self._publish_update)
        self.receiver, self.downloader = ChunkReceiver(self.updater), Downloader(self.updater)
        threading.Thread(target=watch_inbox, args=(self.updater, self.stop_event), name="inbox", daemon=True).start()
        threading.Thread(target=self.receiver.run_sweeper, args=(self.stop_event,), name="sweeper", daemon=True).start()

    def _on_bundle_message(self, topic: str, payload: bytes) -> None:
        self.receiver.on_message(topic[len(self.link.topics.prefix):], payload)

    def run(self) -> int:
        """Boot, serve until stopped or the source ends, drain, exit 0. Not serving: wait until stopped."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        # results carry (boot, seq): unique across restarts, so a subscriber can prove nothing was lost
        self.boot_number = bump_counter(self.cfg.state_dir / "boots")
        self.start_mqtt()  # a broker that is down never delays boot: the link connects in the background
        from agent.link.prometheus import start_metrics_server

        self.metrics_server = start_metrics_server(self.cfg.metrics.listen, self)  # None unless metrics.listen
        ok = self.boot()
        self.start_updates()
        if ok:
            self.start_pipeline()
        # Ready means proven: a candidate passed, or the agent settled in "not serving" and says why.
        self.notifier.ready(self.status_line())
        self.publish_health()
        next_ping = 0.0
        interval = self.cfg.output.health_interval_s
        next_health = time.monotonic() + interval
        while not self.stop_event.is_set():
            if self.pipeline is not None and self.pipeline.done.is_set() and not self.cfg.mqtt.enabled:
                break  # a finite source ended and nothing else can reach us
            self.stop_event.wait(0.1)
            if self.notifier.watchdog_s and time.monotonic() >= next_ping:
                self._watchdog()
                next_ping = time.monotonic() + self.notifier.watchdog_s / 4
            if self.reload_event.is_set():
                self.reload_event.clear()
                self.notifier.reloading()
                self.reload()
                self.notifier.ready(self.status_line())
                while self._reload_waiters:
                    self._reload_waiters.pop().set()
            key = self._health_key()
            if time.monotonic() >= next_health or key != self._last_health_key:
                doc = self.publish_health()
                if key != self._last_health_key:
                    self.notifier.status(self.status_line())
                self._last_health_key = key
                log.info("health", **{k: doc[k] for k in ("serving", "not_serving_reason", "paused", "variant")},
                         **doc["pipeline"])
                next_health = time.monotonic() + interval
        self.notifier.stopping()
        self.stop_pipeline()
        doc = self.health()
        log.info("shutdown", serving=doc["serving"], **doc["pipeline"])
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
            self.link.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        return 0
