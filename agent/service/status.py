"""Health, status and the retained documents: what the agent says about itself, and to whom.

The board builds the health document from the serving state and the components' own reports, publishes
it (retained health, selftest, facts, update status), keeps systemd's STATUS= and watchdog honest, and
hands /metrics the last published document, never live state from another thread.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from agent.link.health import audited
from agent.logsetup import get_logger
from agent.serving.capabilities import Multiplexed
from agent.service.audit import loud_state
from agent.service.health_view import health_document, status_line, watchdog_withheld

if TYPE_CHECKING:
    from agent.service.controller import Controller

log = get_logger("controller")


def sources_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Many sources: each one's state and counts, for the health and shutdown log lines."""
    if not doc.get("sources"):
        return {}
    keep = ("state", "frames", "served", "stale", "left_at_stop", "decoder")
    return {"sources": {n: {k: v[k] for k in keep} for n, v in doc["sources"].items()}}


class StatusBoard:
    """Owns what was last said: health, the update status, the last failure, the loud state in the journal."""

    def __init__(self, hub: Controller):
        self.hub = hub
        self.last_health: dict[str, Any] | None = None
        self.last_health_key: Any = None
        self.last_update: dict[str, Any] | None = None
        self.last_failure: dict[str, Any] | None = None  # the last rejected / rolled-back update, for the facts
        self.loud_logged: str | None = None  # the loud state (pinned, degraded) the journal last said

    # -- read ----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What /metrics reads, on its HTTP thread: the health document last published (every
        output.health_interval_s and on every change), never live engine, pipeline or outbox state."""
        doc = self.last_health
        if doc is None:  # before the first publish: say so rather than read live state from another thread
            hub = self.hub
            return {"device_id": hub.cfg.device_id, "serving": False, "not_serving_reason": "starting",
                    "uptime_s": round(time.monotonic() - hub.started, 1)}
        return doc

    def health(self) -> dict[str, Any]:
        hub, s = self.hub, self.hub.served
        link, updater = hub.link, hub.updates.updater
        doc = health_document(
            device_id=hub.cfg.device_id, started=hub.started, session=link.session if link else 0,
            interval_s=hub.cfg.output.health_interval_s, serving=s.serving,
            not_serving_reason=None if s.serving else (s.reason or s.idle_reason()),
            engine=s.engine, pipeline=s.pipeline, selftest_doc=s.report, outbox=hub.outbox,
            probe=hub.probe, operation=hub.slot.name, decode_limit=s.decode_limit,
            mqtt_connected=link.connected.is_set() if link is not None else None, update=self.last_update,
            update_machine=updater.machine.snapshot.to_dict() if updater is not None else None,
        ) | {"reproof": hub.reproof.to_dict(), "audit": hub.auditor.to_dict(), "reload_refused": hub.reloads.refused,
              "identity": {"instance": hub.instance, "twin": link.twin if link is not None else None}}
        if doc["selftest"]:  # drift while serving: the proof's verdict is degraded here too, never "pass"
            doc["selftest"] = audited(doc["selftest"], doc["audit"])
        return doc

    def status_text(self) -> str:
        """systemd's STATUS=, with what an operator must see beside "serving" (degraded, pinned); never "None"."""
        s = self.hub.served
        loud = loud_state(s.report, self.hub.auditor.to_dict()) if s.serving else None
        line = status_line(s.serving, s.engine, s.reason or s.idle_reason())
        return f"{line} — {loud}" if loud else line

    def journal_loud(self) -> None:
        """A loud state that newly applies (an update or rollback that serves a pinned below-floor
        candidate, a drift) goes to the journal once, as the boot's does; STATUS says it at the same time."""
        s = self.hub.served
        loud = loud_state(s.report, self.hub.auditor.to_dict()) if s.serving else None
        if loud and loud != self.loud_logged:
            log.warning("serving.loud", state=loud, status=self.status_text(), warnings=(s.report or {}).get("warnings"))
        self.loud_logged = loud

    def health_key(self) -> Any:
        """What, changed, publishes health at once. The STATUS text itself is part of it: an update that keeps
        the variant changes the version it names and may bring a loud state (pinned below floor) with it."""
        p = self.hub.served.pipeline
        return (self.hub.served.serving, self.hub.served.reason, self.status_text(), self.hub.auditor.to_dict()["state"],
                p.source.stats.state if p else None, bool(p and p.paused.is_set()), p.failed if p else None,
                p.source.state_key() if p and isinstance(p.source, Multiplexed) else None)  # many: one turns stuck

    def facts(self) -> dict[str, Any]:
        """The retained facts a fleet rollout targets on and gates with (agent/fleet/facts.py)."""
        from agent.fleet.facts import device_facts
        from agent.link.health import versions
        from agent.proof.isa import cpu_isa

        hub, s = self.hub, self.hub.served
        b, engine, store = s.bundle, s.engine, hub.updates.store
        return device_facts(
            device_id=hub.cfg.device_id, session=hub.link.session if hub.link else 0, labels=hub.cfg.labels,
            versions=versions(), report=s.report,
            effective=list(engine.describe()["effective_providers"]) if engine else None,
            current=store.current_id if store else None, committed=store.committed_id if store else None,
            active=None if b is None else {"name": b.manifest.name, "version": b.manifest.version,
                                           "sha": b.manifest_sha256[:12]},
            last_failure=self.last_failure,
            budget_ms=b.manifest.selftest.budget_for(engine.describe()["provider"]) if b and engine else None,
            device=cpu_isa(), previous=store.previous_committed() if store else None)

    def retained(self) -> dict[str, bytes]:
        """paho's thread, on connect: the last documents the controller published (never its live state)."""
        hub = self.hub
        assert hub.link is not None  # called by the link itself
        topics = hub.link.topics
        out = {}
        if self.last_health is not None:
            out[topics.health] = json.dumps(self.last_health).encode()
        if hub.served.report is not None:
            out[topics.selftest] = json.dumps(hub.served.report).encode()
        if self.last_update is not None:
            out[topics.update_status] = json.dumps(self.last_update).encode()
        out[topics.facts] = json.dumps(self.facts()).encode()
        if hub.cfg.mqtt.homeassistant:
            from agent.link.discovery import discovery_messages

            out.update(discovery_messages(hub.cfg, topics))
        return out

    # -- publish (controller thread) -------------------------------------------------------------------
    def publish_health(self, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = self.last_health = doc if doc is not None else self.health()
        link = self.hub.link
        if link is not None:
            link.publish_retained(link.topics.health, json.dumps(doc).encode())
            for name, one in (doc.get("sources") or {}).items():
                link.publish_retained(link.topics.source_health(name),
                                      json.dumps({"ts": doc["ts"], "source": name, **one}).encode())
        return doc

    def publish_selftest(self) -> None:
        link, report = self.hub.link, self.hub.served.report
        if link is not None and report is not None:
            link.publish_retained(link.topics.selftest, json.dumps(report).encode())
        self.publish_facts()

    def publish_facts(self) -> None:
        link = self.hub.link
        if link is not None:
            link.publish_retained(link.topics.facts, json.dumps(self.facts()).encode())

    def publish_update(self, doc: dict[str, Any]) -> None:
        """Any thread: the status goes to the controller's queue, so `last_update` has one writer."""
        from agent.service.events import UpdateStatus

        hub = self.hub
        if hub.on_own_thread():
            self.apply_update_status(doc)
        elif not hub.post(UpdateStatus(doc), timeout=5):
            log.error("update.status_dropped", update=doc.get("update"), state=doc.get("state"),
                      reason="controller queue full for 5 s")

    def apply_update_status(self, doc: dict[str, Any]) -> None:
        self.last_update = doc
        link = self.hub.link
        if link is not None:
            link.publish_retained(link.topics.update_status, json.dumps(doc).encode())
        if doc.get("state") in ("committed", "rejected", "rolled_back"):
            if doc["state"] != "committed":
                self.last_failure = doc
            self.publish_facts()  # after the verdict: a rollout counts a commit once the facts show it

    def watchdog(self) -> None:
        """Feed only while frames really flow, or while not serving by design; a dead or hung stage misses it."""
        hub = self.hub
        reason = watchdog_withheld(hub.served.pipeline, max((hub.notifier.watchdog_s or 0.0) / 2, 1.0))
        if reason is None:
            hub.notifier.watchdog()
        else:
            log.error("watchdog.withheld", reason=reason)
            p = hub.served.pipeline
            hub.notifier.status(f"{'NOT serving' if p is not None and p.failed is not None else 'STALLED'}: {reason}")

    def tick(self, force: bool) -> bool:
        """The loop's health beat: publish when due (`force`) or when what it says changed. True when published."""
        key = self.health_key()
        if not force and key == self.last_health_key:
            return False
        doc = self.publish_health()
        if key != self.last_health_key:
            self.hub.notifier.status(self.status_text())
            self.journal_loud()
        self.last_health_key = key
        log.info("health", **{k: doc[k] for k in ("serving", "not_serving_reason", "paused", "variant")},
                 **({"reproof": doc["reproof"]} if doc["reproof"]["armed"] else {}),
                 # the stage plan is logged once, as pipeline.stages_sized: not on every health line
                 **{k: v for k, v in (doc["pipeline"] or {}).items() if k not in ("latency_ms", "stages")},
                 decoder=(doc["source"] or {}).get("decoder"), **sources_summary(doc))
        return True


