"""What serves: the bundle, its proven engine, the pipeline and the proof's report, owned by the controller's
thread. Boot, reload, re-proof and update all change it through this one object.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from agent.bundle.load import Bundle
from agent.errors import AgentError, ConfigError, SwapRefused
from agent.logsetup import get_logger
from agent.serving.engine import Engine
from agent.serving.multisource import MultiSource
from agent.serving.pipeline import Pipeline
from agent.serving.sources import FrameSource, is_lossless, open_source, retarget_decode
from agent.service.advice import not_serving_advice
from agent.service.audit import loud_state
from agent.service.boot import BootOutcome
from agent.service.links import make_sink
from agent.service.preflight import can_receive_bundle

if TYPE_CHECKING:
    from agent.service.controller import Controller

log = get_logger("controller")


def proven_decode(cfg: Any, report: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """The source settings to open with, and the decode limit: the largest JPEG scale the self-test proved
    on the serving candidate (1 when the report proves none). A forced `source.decode_scale` above it is
    capped, with a warning: a scale the golden samples never saw is not served."""
    dec = (report or {}).get("decode") or {}
    proven = int(dec.get("max_scale", 1)) if isinstance(dec, dict) else 1
    limit: dict[str, Any] = {"max_scale": proven, "proven": proven, "reason": dec.get("reason") if dec else
                             "the self-test report has no reduced-decode check", "forced": None}
    forced = cfg.picture_scale() or "auto"  # None: a type that never decodes pictures
    if forced != "auto":
        limit["forced"] = int(forced)
        if int(forced) > proven:
            log.warning("source.decode_scale_capped", configured=int(forced), proven=proven, reason=limit["reason"])
            limit["capped"] = f"source.decode_scale {forced} is above the proven {proven}: decoding at 1/{proven}"
            cfg = dataclasses.replace(cfg, decode_scale=proven)
    return cfg, limit


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What served at one moment: put back when a reload's or an update's new state fails."""

    bundle: Bundle | None
    engine: Engine | None
    report: dict[str, Any] | None
    reason: str | None


class Served:
    """The serving state. Its writers run on the controller's thread (directly or through `Controller.call`)."""

    def __init__(self, hub: Controller):
        self.hub = hub
        self.bundle: Bundle | None = None
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.report: dict[str, Any] | None = None  # the proof's report of what serves (selftest/ topic)
        self.decode_limit: dict[str, Any] | None = None  # the proven JPEG decode scale the source runs under
        self.reason: str | None = None  # why nothing serves (None while a proven engine serves)
        self.config_refused: str | None = None  # set at boot: `run` exits non-zero instead of idling forever
        self.next_seq = 1  # seq never repeats within a boot, across reloads and updates

    @property
    def serving(self) -> bool:
        p = self.pipeline
        return p is not None and not p.done.is_set() and p.failed is None

    def snapshot(self) -> Snapshot:
        return Snapshot(self.bundle, self.engine, self.report, self.reason)

    def put(self, s: Snapshot) -> None:
        self.bundle, self.engine, self.report, self.reason = s.bundle, s.engine, s.report, s.reason

    def idle_reason(self) -> str:
        p = self.pipeline
        if p is not None and p.failed is not None:
            return p.failed
        if p is not None and p.done.is_set():
            return "the source ended"
        op = self.hub.slot.name
        return f"{op} in progress" if op else "not started"

    def start_pipeline(self) -> Pipeline:
        hub = self.hub
        assert self.engine is not None and self.bundle is not None
        if hub.stop_event.is_set():  # a boot or an update that finishes during shutdown serves nothing
            raise AgentError("the agent is stopping")
        m, cfg = self.bundle.manifest, hub.cfg
        opened: list[tuple[Any, FrameSource]] = []
        try:
            for one in cfg.source_list:
                src_cfg, self.decode_limit = proven_decode(one, self.report)
                opened.append((one, open_source(src_cfg, m.frame, m.preprocess.resize,
                                                max_scale=self.decode_limit["max_scale"])))
        except AgentError:
            for _, src in opened:
                src.close()
            raise
        if cfg.sources:  # many sources, one session: each source keeps its own policy inside
            source: FrameSource = MultiSource(opened, capacity=cfg.pipeline.queue_size)
            lossless = True
        else:
            source, lossless = opened[0][1], is_lossless(cfg.source, opened[0][1])
        self.pipeline = Pipeline(source, self.engine, make_sink(hub), cfg.pipeline, lossless,
                                 boot=hub.boot_number, first_seq=self.next_seq, instance=hub.instance)
        self.pipeline.max_result_bytes = cfg.output.max_result_bytes
        self.pipeline.live = hub.live_view
        log.info("pipeline.start", source=source.name, lossless=self.pipeline.lossless, first_seq=self.next_seq)
        return self.pipeline.start()

    def retarget_decode(self) -> None:
        """A swapped bundle brings its own resize and proven decode scale: the running source takes them for
        the next frame (a frame in flight carries the scale it was decoded at, so its boxes still map back)."""
        assert self.pipeline is not None and self.bundle is not None
        _, self.decode_limit = proven_decode(self.hub.cfg.source_list[0], self.report)
        src = self.pipeline.source
        for s in ([f.source for f in src.feeds] if isinstance(src, MultiSource) else [src]):
            retarget_decode(s, self.bundle.manifest.preprocess.resize, self.decode_limit["max_scale"])

    def stop_pipeline(self) -> None:
        p = self.pipeline
        if p is None:
            return
        p.stop()
        p.join(timeout=30)
        p.close_source()  # after capture left read(); if it is still inside, capture closes it on its way out
        self.next_seq = max(self.next_seq, p.last_seq + 1)

    def serve_engine(self) -> None:
        """The engine now set serves: swapped into the running pipeline, or a pipeline started for it."""
        assert self.engine is not None
        if self.serving:
            assert self.pipeline is not None  # serving means a live pipeline
            try:
                self.pipeline.swap_engine(self.engine)
            except SwapRefused as exc:  # another sensor frame: its source opened for it, as at boot
                log.info("pipeline.restarted_for_bundle", reason=str(exc))
                self.stop_pipeline()
                self.start_pipeline()
                return
            self.retarget_decode()
        else:
            self.stop_pipeline()
            self.start_pipeline()

    def apply_boot(self, o: BootOutcome) -> None:
        """A proof's outcome (boot, reload, re-proof) becomes the serving state, said in the journal at once."""
        hub = self.hub
        self.bundle, self.engine, self.reason = o.bundle, o.engine, o.reason
        if o.report is not None:
            self.report = o.report
        if o.engine is not None:
            try:
                self.start_pipeline()
            except ConfigError as exc:  # the config names a source that cannot open: no command can fix it
                self.engine, self.reason = None, str(exc)
                self.config_refused = str(exc)
            except AgentError as exc:
                self.engine, self.reason = None, str(exc)
        if self.reason is not None and (o.refused or (o.unservable and not can_receive_bundle(hub.cfg))):
            self.config_refused = self.reason  # no bundle can ever come: exit 1, not idle forever
        if self.reason is None:
            assert self.engine is not None  # no reason: a proven engine serves
            log.info("boot.ready", **self.engine.describe())
            loud = loud_state(self.report, None)
            if loud:  # pinned below floor, too slow: in the journal, not only in health
                log.warning("boot.serving_loudly", state=loud, warnings=(self.report or {}).get("warnings"))
            hub.status.loud_logged = loud
        hub.reproof.after_proof(o.report, self.serving, self.reason)
        if hub.reproof.armed:
            log.warning("reproof.scheduled", **hub.reproof.to_dict())
        if self.reason is not None:
            # the reason, the figure against its bound, the key to change and the next attempt, at once
            log.error("boot.not_serving", reason=self.reason,
                      **not_serving_advice(self.reason, self.report if o.report else None,
                                           hub.reproof.to_dict(), can_receive_bundle(hub.cfg)))
        hub.status.publish_selftest()
