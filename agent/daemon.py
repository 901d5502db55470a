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
from typing import Any, Callable

from agent.bundle import Bundle, load_bundle
from agent.config import Config, SourceConfig, load_config
from agent.engine import Engine, build_engine
from agent.errors import AgentError, ConfigError
from agent.fsio import bump_counter
from agent.health import ProcessProbe, build_health
from agent.logsetup import configure_logging, get_logger
from agent.pipeline import Pipeline, Sink
from agent.selftest import SelftestReport, options_from_config, run_selftest
from agent.sinks import FanOutSink, JsonLinesSink, NullSink, OutboxSink
from agent.sources import is_lossless, open_source

log = get_logger("daemon")

DEMO_BUNDLE = Path("models/digits-classifier")
DEMO_FRAMES = Path("models/demo-frames/digits")
COMMANDS = ("status", "selftest", "reload", "pause", "resume")


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
        self.report: SelftestReport | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.not_serving_reason: str | None = None
        self.started = time.monotonic()
        self.probe = ProcessProbe()
        self.link = None
        self.outbox = None
        self._last_health_key: Any = None
        self._reload_waiters: list[threading.Event] = []
        self.boot_number = 0
        # Called with the health document whenever it is published (systemd STATUS= etc. hook here).
        self.on_health: list[Callable[[dict[str, Any]], None]] = []

    # -- boot --------------------------------------------------------------------------------------------
    def boot(self) -> bool:
        """Load and prove the bundle; True when an engine is ready to serve."""
        cfg = self.cfg
        self.engine = None
        if cfg.bundle is None:
            return self._not_serving("no bundle configured (key bundle)")
        try:
            self.bundle = load_bundle(cfg.bundle)
            self.report = run_selftest(self.bundle, cfg.state_dir, options_from_config(cfg))
        except AgentError as exc:
            return self._not_serving(str(exc))
        finally:
            self._publish_selftest()
        sel = self.report.selected
        if sel is None:
            return self._not_serving(self.report.reason or "no candidate passed")
        engine = build_engine(self.bundle, sel.candidate, cfg.session)
        if sel.candidate.provider not in engine.opened.effective:
            return self._not_serving(f"the serving session for {sel.candidate.key} runs on "
                                     f"{list(engine.opened.effective)}, not the proven provider")
        self.engine = engine
        self.not_serving_reason = None
        log.info("boot.ready", **engine.describe())
        return True

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
        selftest = None
        if self.report is not None:
            selftest = {"passed": self.report.selected is not None, "created": self.report.created,
                        "cached": self.report.cached, "reason": self.report.reason}
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
            selftest=selftest,
            pipeline=status.metrics if status else None,
            source=source,
            outbox=self.outbox.stats() if self.outbox is not None else None,
            process=self.probe.sample(),
            paused=bool(p and p.paused.is_set()),
        )

    def publish_health(self) -> dict[str, Any]:
        doc = self.health()
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
        for hook in self.on_health:
            hook(doc)
        return doc

    def _health_key(self) -> Any:
        """What counts as a change worth publishing at once."""
        p = self.pipeline
        return (self.serving, self.not_serving_reason, self.engine.describe()["variant"] if self.engine else None,
                p.source.stats.state if p else None, bool(p and p.paused.is_set()))

    def _publish_selftest(self) -> None:
        if self.link is not None and self.report is not None:
            self.link.publish_retained(self.link.topics.selftest, json.dumps(self.report.to_dict()).encode())

    def _retained(self) -> dict[str, bytes]:
        assert self.link is not None
        out = {self.link.topics.health: json.dumps(self.health()).encode()}
        if self.report is not None:
            out[self.link.topics.selftest] = json.dumps(self.report.to_dict()).encode()
        if self.cfg.mqtt.homeassistant:
            from agent.homeassistant import discovery_messages

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
                self.report = report
            self._publish_selftest()
            doc = report.to_dict()
            return {"ok": True, "passed": doc["passed"], "selected": doc["selected"], "reason": doc["reason"]}
        if cmd.name == "reload":
            done = threading.Event()
            self._reload_waiters.append(done)
            self.reload_event.set()
            done.wait(timeout=120)
            return {"ok": self.not_serving_reason is None, "serving": self.serving,
                    "reason": self.not_serving_reason, "config": str(self.cfg.source_file)}
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
    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()
        if self.pipeline is not None:
            self.pipeline.stop()

    def request_reload(self, *_: Any) -> None:
        self.reload_event.set()

    def start_mqtt(self) -> None:
        if not self.cfg.mqtt.enabled:
            return
        from agent.mqtt import MqttLink
        from agent.outbox import Outbox

        self.outbox = Outbox(self.cfg.state_dir / "outbox.sqlite", self.cfg.outbox)
        self.link = MqttLink(self.cfg.mqtt, self.cfg.device_id, self.cfg.state_dir, self.outbox,
                             self.handle_command, self._retained).start()

    def run(self) -> int:
        """Boot, serve until stopped or the source ends, drain, exit 0. Not serving: wait until stopped."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        # results carry (boot, seq): unique across restarts, so a subscriber can prove nothing was lost
        self.boot_number = bump_counter(self.cfg.state_dir / "boots")
        self.start_mqtt()  # a broker that is down never delays boot: the link connects in the background
        if self.boot():
            self.start_pipeline()
        self.publish_health()
        interval = self.cfg.output.health_interval_s
        next_health = time.monotonic() + interval
        while not self.stop_event.is_set():
            if self.pipeline is not None and self.pipeline.done.is_set() and not self.cfg.mqtt.enabled:
                break  # a finite source ended and nothing else can reach us
            self.stop_event.wait(0.1)
            if self.reload_event.is_set():
                self.reload_event.clear()
                self.reload()
                while self._reload_waiters:
                    self._reload_waiters.pop().set()
            key = self._health_key()
            if time.monotonic() >= next_health or key != self._last_health_key:
                doc = self.publish_health()
                self._last_health_key = key
                log.info("health", **{k: doc[k] for k in ("serving", "not_serving_reason", "paused", "variant")},
                         **doc["pipeline"])
                next_health = time.monotonic() + interval
        self.stop_pipeline()
        doc = self.health()
        log.info("shutdown", serving=doc["serving"], **doc["pipeline"])
        if self.link is not None:
            self.link.publish_retained(self.link.topics.health, json.dumps(doc).encode())
            self.link.stop()
        return 0
