"""The agent's boot sequence and main loop: config -> bundle -> self-test -> engine -> pipeline -> serve.

Nothing is served from an unproven setup: when the self-test selects nothing (or the bundle does not
load), the agent stays up, not serving, and says why, so a new bundle or command can still reach it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from agent.bundle import Bundle, load_bundle
from agent.config import Config, OutputConfig, SourceConfig
from agent.engine import Engine, build_engine
from agent.errors import AgentError, ConfigError
from agent.logsetup import get_logger
from agent.pipeline import Pipeline, Sink
from agent.selftest import SelftestReport, options_from_config, run_selftest
from agent.sinks import JsonLinesSink, NullSink
from agent.sources import is_lossless, open_source

log = get_logger("daemon")

DEMO_BUNDLE = Path("models/digits-classifier")
DEMO_FRAMES = Path("models/demo-frames/digits")


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
        self.sink = sink
        self.stop_event = threading.Event()
        self.bundle: Bundle | None = None
        self.report: SelftestReport | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.not_serving_reason: str | None = None
        self.started = time.monotonic()

    # -- boot --------------------------------------------------------------------------------------------
    def boot(self) -> bool:
        """Load and prove the bundle; True when an engine is ready to serve."""
        cfg = self.cfg
        if cfg.bundle is None:
            self.not_serving_reason = "no bundle configured (key bundle)"
            log.error("boot.no_bundle", reason=self.not_serving_reason)
            return False
        try:
            self.bundle = load_bundle(cfg.bundle)
            self.report = run_selftest(self.bundle, cfg.state_dir, options_from_config(cfg))
        except AgentError as exc:
            self.not_serving_reason = str(exc)
            log.error("boot.bundle_refused", reason=self.not_serving_reason)
            return False
        sel = self.report.selected
        if sel is None:
            self.not_serving_reason = self.report.reason
            log.error("boot.not_serving", reason=self.not_serving_reason)
            return False
        engine = build_engine(self.bundle, sel.candidate, cfg.session)
        if sel.candidate.provider not in engine.opened.effective:
            self.not_serving_reason = (f"the serving session for {sel.candidate.key} runs on "
                                       f"{list(engine.opened.effective)}, not the proven provider")
            log.error("boot.not_serving", reason=self.not_serving_reason)
            return False
        self.engine = engine
        self.not_serving_reason = None
        log.info("boot.ready", **engine.describe())
        return True

    # -- serve -------------------------------------------------------------------------------------------
    def start_pipeline(self) -> Pipeline:
        assert self.engine is not None and self.bundle is not None
        source = open_source(self.cfg.source, self.bundle.manifest.frame)
        sink = self.sink or (JsonLinesSink() if self.cfg.output.stdout else NullSink())
        self.pipeline = Pipeline(source, self.engine, sink, self.cfg.pipeline, is_lossless(self.cfg.source, source))
        log.info("pipeline.start", source=source.name, lossless=self.pipeline.lossless)
        return self.pipeline.start()

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "uptime_s": round(time.monotonic() - self.started, 1),
            "serving": self.pipeline is not None and not self.pipeline.done.is_set(),
            "not_serving_reason": self.not_serving_reason,
        }
        if self.report is not None:
            doc["selftest"] = {"passed": self.report.selected is not None, "created": self.report.created,
                               "cached": self.report.cached}
        if self.pipeline is not None:
            st = self.pipeline.status()
            doc.update(engine=st.engine, source_state=st.source_state, last_frame_age_s=st.last_frame_age_s,
                       **st.metrics)
        return doc

    def request_stop(self, *_: Any) -> None:
        self.stop_event.set()
        if self.pipeline is not None:
            self.pipeline.stop()

    def run(self) -> int:
        """Boot, serve until stopped or the source ends, drain, exit 0. Not serving: wait until stopped."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        if self.boot():
            self.start_pipeline()
        next_health = time.monotonic() + self.cfg.output.health_interval_s
        while not self.stop_event.is_set():
            if self.pipeline is not None and self.pipeline.done.is_set():
                break
            self.stop_event.wait(0.2)
            if time.monotonic() >= next_health:
                log.info("health", **self.health())
                next_health += self.cfg.output.health_interval_s
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline.join(timeout=30)
            self.pipeline.source.close()
            log.info("shutdown", **self.health())
        return 0
