"""Reload (SIGHUP, cmd/reload), the scheduled re-proof, and what a drift seen while serving sets off.

A reload reads the config again and proves it like a boot; one that fails never drops the proven engine
that served before it. Requests that arrive while another operation runs wait for it (never interleaved
with an update); requests while a reload runs are answered by that reload.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from agent.config import Config, load_config
from agent.errors import AgentError, ConfigError
from agent.logsetup import configure_logging, get_logger
from agent.service import evidence
from agent.service.boot import BootOutcome, boot
from agent.service.events import Reply
from agent.service.served import Snapshot

if TYPE_CHECKING:
    from agent.service.controller import Controller

log = get_logger("controller")


@dataclasses.dataclass(frozen=True)
class _Before:
    """What served before a reload: restored when the reload's proof or start fails."""

    cfg: Config
    served: Snapshot


class Reloads:
    """Owns the pending reload, its waiting replies and the last refusal (health `reload_refused`)."""

    def __init__(self, hub: Controller):
        self.hub = hub
        self.pending = False
        self._replies: list[Reply] = []
        self.refused: dict[str, Any] | None = None  # the last reload that kept the proven engine, and why

    def request(self, reply: Reply | None) -> None:
        hub = self.hub
        if reply is not None:
            self._replies.append(reply)
        holder = hub.slot.try_take("reload")
        if holder == "reload":
            log.info("reload.coalesced", detail="a reload is already running; this request is answered by it")
        elif holder is not None:
            self.pending = True  # after the operation in progress: never interleaved with an update
            log.info("reload.deferred", behind=holder)
        else:
            self.pending = False
            hub.notifier.reloading()
            hub.slot.spawn("reload", self._job, release=False)

    def _job(self) -> None:
        hub = self.hub
        try:
            new = self._read_config()
            if new is not None:
                before: _Before = hub.call(lambda: self._stop_for(new))
                try:
                    outcome = boot(hub.cfg, hub.updates.store)
                except Exception as exc:  # noqa: BLE001 -- any failure of the proof is a refusal, never a dark device
                    # (a read-only state disk's EROFS, a bug): the proven engine that served before serves on
                    log.exception("reload.proof_raised", error=f"{type(exc).__name__}: {exc}")
                    outcome = BootOutcome(None, None, None, f"the reload's proof failed: {type(exc).__name__}: {exc}")
                hub.call(lambda: self._apply(outcome, before))
        finally:
            try:
                hub.call(self._done)
            finally:
                hub.slot.release()  # no-op when _done released it already

    def _read_config(self) -> Config | None:
        cfg = self.hub.cfg
        if cfg.source_file is None:
            return cfg
        try:
            new = load_config(cfg.source_file)
        except ConfigError as exc:
            log.error("reload.refused", reason=str(exc))  # keep serving what we had
            return None
        if new.mqtt != cfg.mqtt:
            log.warning("reload.mqtt_unchanged", detail="mqtt settings apply at the next restart")
            new = dataclasses.replace(new, mqtt=cfg.mqtt)
        u = cfg.updates
        if (new.updates.enabled, new.updates.inbox) != (u.enabled, u.inbox) or new.metrics != cfg.metrics:
            log.warning("reload.restart_needed", detail="updates.enabled, updates.inbox and metrics apply at the next "
                        "restart; the other updates settings (trusted_keys, limits, probation) apply now")
            new = dataclasses.replace(new, updates=dataclasses.replace(new.updates, enabled=u.enabled, inbox=u.inbox),
                                      metrics=cfg.metrics)
        return new

    def _stop_for(self, new: Config) -> _Before:
        hub, s = self.hub, self.hub.served
        log.info("reload.start", config=str(new.source_file))
        before = _Before(hub.cfg, s.snapshot())
        self.use_config(new)
        s.stop_pipeline()
        s.pipeline = None
        s.engine, s.reason = None, "reloading"
        return before

    def use_config(self, cfg: Config) -> None:
        self.hub.cfg = cfg
        self.hub.updates.use_config(cfg)  # a revoked key stops verifying now
        configure_logging(cfg.log.level, cfg.log.json)

    def _apply(self, o: BootOutcome, before: _Before) -> None:
        """A reload whose proof or start fails never drops the proven engine that served before it: that engine
        serves on under the config it served with, and the refusal is said (journal, health `reload_refused`,
        the command's reply), as an update rolls back. A hash mismatch on a file altered on disk used to leave the
        device serving nothing although the proven session in memory was fine."""
        s, prev = self.hub.served, before.served
        if o.engine is not None:
            s.apply_boot(o)
            if s.serving or prev.engine is None:
                self.refused = None
                return
            why = s.reason or "the new engine did not start"
        elif prev.engine is None:
            s.apply_boot(o)  # nothing proven served before: the reload's verdict is the state
            return
        else:
            why = o.reason or "no candidate passed"
        self.use_config(before.cfg)
        # a source the reloaded config named that cannot open is this reload's refusal, not a reason to exit
        s.config_refused = None
        s.put(dataclasses.replace(prev, reason=None))
        try:
            s.start_pipeline()
        except AgentError as exc:  # the source it served from is gone too: nothing serves, saying both
            s.engine, s.reason = None, f"{why}; and the previous engine could not restart: {exc}"
            log.error("boot.not_serving", reason=s.reason)
            return
        self.refused = {"reason": why, "ts": round(time.time(), 3), "serving": prev.engine.candidate.key}
        log.error("reload.refused", reason=why, kept=prev.engine.candidate.key,
                  detail="the proven engine that served before the reload serves on; fix the cause and reload again")
        self.hub.status.publish_selftest()

    def _done(self) -> None:
        # Released here, on the controller's thread: a reload request handled after this line starts a
        # new reload instead of joining one whose answers were already sent.
        hub, s = self.hub, self.hub.served
        hub.slot.release()
        hub.notifier.ready(hub.status.status_text())
        hub.status.publish_health()
        replies, self._replies = self._replies, []
        refused = self.refused["reason"] if self.refused else None
        for reply in replies:
            reply({"ok": s.reason is None and refused is None, "serving": s.serving,
                   "reason": s.reason or (refused and f"reload refused, the previous engine serves: {refused}"),
                   "config": str(hub.cfg.source_file)})

    # -- re-proof and drift ----------------------------------------------------------------------------
    def start_reproof_if_due(self) -> None:
        hub = self.hub
        if hub.reproof.due() and hub.slot.try_take("reproof") is None:
            hub.reproof.started()
            hub.slot.spawn("reproof", self._reproof_job, release=False)

    def _reproof_job(self) -> None:
        """A scheduled re-proof (reproof.py): the boot's proof again, applied like a boot's."""
        hub = self.hub
        try:
            log.info("reproof.start", attempt=hub.reproof.attempts + 1, load=round(os.getloadavg()[0], 2))
            outcome = boot(hub.cfg, hub.updates.store)
            hub.call(lambda: hub.served.apply_boot(outcome) if hub.served.engine is None else None)  # else: served
        finally:
            try:
                hub.call(self._reproof_done)
            finally:
                hub.slot.release()

    def _reproof_done(self) -> None:
        hub, s = self.hub, self.hub.served
        hub.slot.release()
        if hub.reproof.armed and hub.reproof.next_at is None:  # not applied (served meanwhile, or it raised)
            hub.reproof.after_proof(s.report, s.serving, s.reason)
        if s.serving and s.engine is not None:
            log.info("reproof.serving", healed_after=hub.reproof.to_dict()["healed"], **s.engine.describe())
        hub.notifier.status(hub.status.status_text())
        hub.status.publish_health()

    def on_drift(self, drift: dict[str, Any]) -> None:
        """The audit saw answers drift: degraded (health, STATUS, /metrics), and proven again."""
        hub = self.hub
        hub.notifier.status(hub.status.status_text())
        hub.status.publish_health()
        plan = evidence.on_drift(hub, drift)  # charged to the candidate: a golden-only re-proof never clears it
        if plan == "switch" and hub.slot.try_take("switch") is None:
            log.error("audit.reproving", how="switch", **drift)
            hub.slot.spawn("switch", evidence.switch_job, hub, drift)
        elif plan in ("switch", "reload"):
            log.error("audit.reproving", how="reload", **drift)
            self.request(None)
        elif plan == "selftest" and hub.served.bundle is not None and hub.slot.try_take("selftest") is None:
            log.error("audit.reproving", how="selftest", **drift)
            hub.slot.spawn("selftest", hub.commands.selftest_job, hub.served.bundle,
                           lambda r: log.warning("audit.reproof_done", passed=r.get("passed"),
                                                 selected=r.get("selected"), reason=r.get("reason")))
