"""The agent's outward links, opened by the controller at start: the MQTT link and its outbox, the result
sinks, the live view and the /metrics server. Each is imported only when the config enables it."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from agent.logsetup import get_logger
from agent.serving.pipeline import Sink
from agent.serving.sinks import FanOutSink, JsonLinesSink, NullSink, OutboxSink
from agent.service.boot import memory_dir

if TYPE_CHECKING:
    from agent.service.controller import Controller

log = get_logger("controller")


def make_sink(hub: Controller) -> Sink:
    """Where a pipeline's results go: stdout, the outbox (MQTT), and a sink the caller gave."""
    cfg = hub.cfg
    sinks: list[Sink] = []
    # the outbox first: a result is counted as held (agent/link/held.py) before it is printed, so a kill
    # between the two over-counts a loss; stdout first left a printed result that no count knew of
    if hub.outbox is not None and hub.link is not None:
        topics = hub.link.topics
        sinks.append(OutboxSink(hub.outbox, topics.predictions, cfg.mqtt.qos, cfg.mqtt.batch_predictions,
                                topic_for=topics.source_predictions if cfg.sources else None,
                                stream_topic_for=topics.stream_predictions))
    if cfg.output.stdout:
        sinks.append(JsonLinesSink())
    if hub.extra_sink is not None:
        sinks.append(hub.extra_sink)
    return FanOutSink(*sinks) if sinks else NullSink()


def start_mqtt(hub: Controller) -> None:
    cfg = hub.cfg
    if not cfg.mqtt.enabled:
        return
    from agent.link.mqtt import MqttLink
    from agent.link.outbox import Outbox

    import sqlite3  # the outbox's, imported with it

    try:
        hub.outbox = Outbox(cfg.state_dir / "outbox.sqlite", cfg.outbox)
    except (OSError, sqlite3.Error) as exc:
        # a state disk full at boot (SQLite cannot even start its journal; on a disk that already holds an outbox
        # it says "disk I/O error", not "full"), read-only or damaged: the results go through an outbox in memory,
        # as they do when the disk fills later; a backlog on the disk waits for a restart that can open it.
        # Exiting here left the device down and silent.
        full = "full" in str(exc) or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) \
            or _free_bytes(cfg.state_dir) < FULL_BELOW_BYTES
        spare_dir = memory_dir(cfg.state_dir)
        log.error("outbox.state_disk_full" if full else "outbox.state_disk_unusable",
                  file=str(cfg.state_dir / "outbox.sqlite"), error=f"{type(exc).__name__}: {exc}",
                  instead=str(spare_dir / "outbox.sqlite"),
                  reason=("disk full" if full else "the outbox on the state disk cannot open")
                  + ": results are kept in memory until the broker takes them")
        hub.outbox = Outbox(spare_dir / "outbox.sqlite", cfg.outbox)
    hub.link = MqttLink(cfg.mqtt, cfg.device_id, cfg.state_dir, hub.outbox, hub.command_inlet(), hub.status.retained,
                        on_bundle=hub.on_bundle_message if cfg.updates.enabled else None, instance=hub.instance)
    hub.link.start()


FULL_BELOW_BYTES = 1 << 20  # a state disk with less free space than this is reported full


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def start_observers(hub: Controller) -> None:
    """The live view (MQTT's cmd/snapshot draws with it; nothing is kept until asked) and /metrics."""
    from agent.link.prometheus import start_metrics_server

    served_live = bool(hub.cfg.metrics.listen and hub.cfg.metrics.live_view)
    if served_live or hub.link is not None:
        from agent.link.liveview import LiveView

        hub.live_view = LiveView(hub.health_snapshot)
    hub.metrics_server = start_metrics_server(hub.cfg.metrics.listen, hub,
                                              hub.live_view if served_live else None)  # None unless set
