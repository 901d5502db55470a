"""Commands from MQTT (`cmd/<name>`): answered on the controller's thread, slow ones on a job thread.

status, pause, resume, selftest, reload, update, rollback and snapshot. The link calls `CommandInlet` on its
network thread; it posts and returns at once, and the controller replies through the link when it has the
answer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from agent.bundle.load import Bundle
from agent.logsetup import get_logger
from agent.service.boot import prove
from agent.service.events import EVENT_QUEUE_SIZE, CommandEvent, Reply

if TYPE_CHECKING:
    from agent.link.mqtt import Command
    from agent.service.controller import Controller

log = get_logger("controller")

COMMANDS = ("status", "selftest", "reload", "pause", "resume", "update", "rollback", "snapshot")
SNAPSHOT_WAIT_S = 5.0  # cmd/snapshot waits this long (at most SNAPSHOT_WAIT_MAX_S when asked) for a served frame
SNAPSHOT_WAIT_MAX_S = 30.0


class Commands:
    """Dispatches commands; owns the one snapshot job that may wait for frames."""

    def __init__(self, hub: Controller):
        self.hub = hub
        self._snapshot_busy = False  # a cmd/snapshot job is waiting for its frames

    def handle(self, cmd: Command, reply: Reply) -> None:
        hub, s = self.hub, self.hub.served
        name = cmd.name
        if name == "status":
            reply({"ok": True, "health": hub.status.health()})
        elif name in ("pause", "resume"):
            self._pause(name, reply)
        elif name == "selftest":
            if s.bundle is None:
                reply({"ok": False, "error": f"no bundle loaded: {s.reason}"})
                return
            holder = hub.slot.try_take("selftest")
            if holder == "selftest":
                reply({"ok": False, "already_running": True, "error": "already running: a self-test is in progress"})
            elif holder is not None:
                reply({"ok": False, "busy": True, "error": f"busy: {holder} in progress; try again after it"})
            else:
                hub.slot.spawn("selftest", self.selftest_job, s.bundle, reply)
        elif name == "reload":
            hub.reloads.request(reply)
        elif name in ("update", "rollback"):
            hub.updates.command(cmd, reply)
        elif name == "snapshot":
            self._snapshot(cmd, reply)
        else:
            reply({"ok": False, "error": f"unknown command {name!r} (known: {', '.join(COMMANDS)})"})

    def _pause(self, name: str, reply: Reply) -> None:
        hub, p = self.hub, self.hub.served.pipeline
        if p is None:
            reply({"ok": False, "error": f"not serving: {hub.served.reason}"})
            return
        if name == "pause" and (hub.slot.name or "").startswith(("update", "rollback")):
            # probation judges the frames the new bundle serves: a pause now would fail a good bundle
            reply({"ok": False, "busy": True, "error": f"busy: {hub.slot.name} in progress; pause after its verdict"})
            return
        (p.paused.set if name == "pause" else p.paused.clear)()
        hub.status.publish_health()
        reply({"ok": True, "paused": p.paused.is_set()})

    def selftest_job(self, bundle: Bundle, reply: Reply) -> None:
        hub = self.hub
        proof = prove(bundle.root, hub.cfg, use_cache=False)

        def apply() -> None:
            if proof.report is not None:
                hub.served.report = proof.report
                hub.status.publish_selftest()

        hub.call(apply)
        doc = proof.report or {}
        reply({"ok": proof.report is not None, "passed": proof.passed, "selected": doc.get("selected"),
               "reason": proof.reason, "crashes": [c["step"] + ": " + c["signal"] for c in doc.get("crashes", [])]})

    def _snapshot(self, cmd: Command, reply: Reply) -> None:
        """cmd/snapshot `{source?, timeout_s?}`: the next frame each asked source serves, its result drawn (the live
        view's drawing), one JPEG on `<prefix>snapshot/<source>`; the reply names the topics. Nothing is kept while
        nobody asks: the request marks the next frame wanted, and a job thread waits for it (one at a time)."""
        hub = self.hub
        pipeline, view, link = hub.served.pipeline, hub.live_view, hub.link
        if pipeline is None or view is None or link is None:
            reply({"ok": False, "error": f"not serving: {hub.served.reason}" if pipeline is None
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
        hub.slot.spawn("snapshot", self._snapshot_job, [asked] if asked is not None else list(known), float(wait),
                       reply, release=False)

    def _snapshot_job(self, sources: list[str], wait_s: float, reply: Reply) -> None:
        from agent.link.liveview import bounded_jpeg, draw

        try:
            view, link = self.hub.live_view, self.hub.link
            assert view is not None and link is not None
            since = view.asked()
            deadline = time.monotonic() + wait_s
            shots, errors = [], []
            for source in sources:
                kept = view.served_since(source, since, max(0.0, deadline - time.monotonic()))
                if kept is None:
                    p = self.hub.served.pipeline
                    paused = p is not None and p.paused.is_set()
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


class CommandInlet:
    """What the MQTT link calls for a command, on its network thread: post and return at once.

    The controller replies through the link when it has the answer; a full queue is answered "busy"
    here, so no thread is ever started per command."""

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
