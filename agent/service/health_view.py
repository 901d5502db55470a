"""What the controller tells the world about itself: the health document, systemd's STATUS line, and
whether the watchdog may be fed. Plain functions over the controller's state, read on its thread."""

from __future__ import annotations

import time
from typing import Any

from agent.link.health import ProcessProbe, build_health
from agent.serving.capabilities import Multiplexed, ReportsStreams
from agent.serving.engine import Engine
from agent.serving.pipeline import Pipeline


def health_document(*, device_id: str, started: float, session: int, interval_s: float, serving: bool,
                    not_serving_reason: str | None, engine: Engine | None, pipeline: Pipeline | None,
                    selftest_doc: dict[str, Any] | None, outbox: Any, probe: ProcessProbe,
                    operation: str | None, mqtt_connected: bool | None = None,
                    update: dict[str, Any] | None = None,
                    decode_limit: dict[str, Any] | None = None,
                    update_machine: dict[str, Any] | None = None) -> dict[str, Any]:
    status = pipeline.status() if pipeline is not None else None
    source = None
    metrics = None
    if pipeline is not None and status is not None:
        st = pipeline.source.stats
        source = {"name": pipeline.source.name, "state": st.state, "last_frame_age_s": status.last_frame_age_s,
                  "frames": st.frames, "bad": st.bad, "reconnects": st.reconnects, "losses": st.losses,
                  "frozen_events": st.frozen_events,
                  # how frames are decoded (path, codec, scale, threads, hw) and the scale the self-test proved
                  "decoder": {**st.decoder, "limit": dict(decode_limit) if decode_limit else None}}
        if isinstance(pipeline.source, ReportsStreams):  # sensor streams: each UDP sender / writer session by name
            source["streams"] = pipeline.source.streams_health()
        if isinstance(pipeline.source, Multiplexed):  # many sources: which are stuck inside a read (seconds)
            source["stuck"] = pipeline.source.stuck()
        metrics = {**status.metrics, "dropped_by_reason": dict(pipeline.drops), "last_seq": pipeline.last_seq}
    doc = build_health(
        device_id=device_id,
        uptime_s=time.monotonic() - started,
        session=session,
        interval_s=interval_s,
        serving=serving,
        not_serving_reason=not_serving_reason,
        engine=engine.describe() if engine else None,
        placement=dict(engine.opened.placement.nodes_by_provider) if engine else None,
        selftest=selftest_doc,  # health_selftest(): the same figures /metrics and the report page show
        pipeline=metrics,
        source=source,
        outbox=outbox.stats() if outbox is not None else None,
        process=probe.sample(),
        paused=bool(pipeline and pipeline.paused.is_set()),
        mqtt_connected=mqtt_connected,
        update=update,
    )
    doc["operation"] = operation  # "reload", "selftest", "update <id>" while one runs
    if update_machine is not None:  # the update state machine's current state (docs/updates.md)
        doc["update_machine"] = update_machine
    many = pipeline.source if pipeline is not None and isinstance(pipeline.source, Multiplexed) else None
    doc["sources"] = many.per_source() if many is not None else None  # many sources: each one's own health
    return doc


def status_line(serving: bool, engine: Engine | None, not_serving_reason: str | None) -> str:
    """systemd's STATUS=: what serves, or why nothing does."""
    if serving and engine is not None:
        d = engine.describe()
        return f"serving {d['bundle']} v{d['version']} {d['variant']} on {d['provider']}"
    return f"NOT serving: {not_serving_reason or 'starting'}"  # never "None": before boot there is no reason yet


def watchdog_withheld(pipeline: Pipeline | None, horizon_s: float) -> str | None:
    """Why the watchdog must not be fed, or None. A dead stage withholds it at once; a hung one after
    `horizon_s`. Not serving by design (no bundle proven) is not a hang: the agent still answers. With
    many sources, one stuck inside a read is not a hang of the agent while another still serves."""
    if pipeline is None:
        return None
    if pipeline.failed is not None:
        return pipeline.failed
    return pipeline.stalled(horizon_s=horizon_s)
