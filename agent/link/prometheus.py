"""Prometheus metrics on `metrics.listen` (off by default): the agent's health, counters and stage
latency histograms in the exposition format, read at scrape time from the values health is built from.

`prometheus_client` is the optional extra `metrics`, imported only when `metrics.listen` is set. Names
and units follow Prometheus conventions: `edge_agent_` prefix, base units (seconds, bytes), `_total` on
counters, one labelled series per source, stage or candidate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

from agent.errors import AgentError, ConfigError, install_hint
from agent.proof.overall import VERDICTS
from agent.logsetup import get_logger

log = get_logger("metrics")

NS = "edge_agent"
# the update machine's states (agent.updates.machine.State; link/ may not import updates/, so spelled here and
# held equal by tests/updates/test_update_steps.py): an update status's `state` is always one of them
UPDATE_STATES = ("idle", "receiving", "verifying", "staged", "proving", "switching", "probation", "committed",
                 "rolled_back", "rejected")


class MetricsSource(Protocol):
    """What the agent exposes to the collector: its health document and the live pipeline counters."""

    def health(self) -> dict[str, Any]: ...
    def pipeline_metrics(self) -> Any: ...  # a PipelineMetrics or None; else `.pipeline.metrics` is read


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not (0 < int(port) < 65536):
        raise ConfigError(f"key metrics.listen: expected HOST:PORT (e.g. 127.0.0.1:9108), found {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


ENDED = "(ended)"  # the stream label of what sensor streams no longer live lost (see _stream_families)


def _stream_families(health: Mapping[str, Any]) -> Iterator[Any]:
    """Sensor streams (each UDP sender, each writer session; bounded by source.max_streams): what was lost,
    and how far behind the agent is, one series per stream, from health's source.streams (and sources.*)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    found = []
    one = health.get("source") or {}
    if one.get("streams"):
        found.append((str(one.get("name")), one["streams"]))
    for name, doc in (health.get("sources") or {}).items():
        if isinstance(doc, Mapping) and doc.get("streams"):
            found.append((str(name), doc["streams"]))
    if not found:
        return
    lost = CounterMetricFamily(f"{NS}_sensor_lost_samples", "Samples that never reached a window: dropped by the "
                               "socket or shed to keep up (the stream's state started again after each hole); stream "
                               "'(ended)': those of streams no longer live", labels=["source", "stream"])
    dropped = CounterMetricFamily(f"{NS}_sensor_dropped_samples", "Leftover samples of a stream session that ended "
                                  "(fewer than a window); stream '(ended)': those of streams no longer live",
                                  labels=["source", "stream"])
    backlog = GaugeMetricFamily(f"{NS}_sensor_backlog_seconds", "Seconds of a stream's samples waiting to be served",
                                labels=["source", "stream"])
    oldest = GaugeMetricFamily(f"{NS}_sensor_oldest_unserved_age_seconds", "Age of the oldest sample of a stream "
                               "not yet served: how far behind the agent is", labels=["source", "stream"])
    datagrams = CounterMetricFamily(f"{NS}_sensor_lost_datagrams", "Datagrams the UDP socket dropped (its receive "
                                    "buffer was full)", labels=["source"])
    for src, doc in found:
        if _num(doc.get("lost_datagrams")) is not None:
            datagrams.add_metric([src], doc["lost_datagrams"])
        live = doc.get("streams") or {}
        for stream, st in live.items():
            lost.add_metric([src, stream], st.get("lost_samples", 0))
            dropped.add_metric([src, stream], st.get("dropped_samples", 0))
            if _num(st.get("backlog_s")) is not None:
                backlog.add_metric([src, stream], st["backlog_s"])
            oldest.add_metric([src, stream], st.get("oldest_unserved_age_s", 0.0))
        # a stream that times out leaves the live streams, and its series with it: what it lost stays counted
        # under ENDED (the source's totals less the live streams'), so the sum per source never falls
        for fam, key in ((lost, "lost_samples"), (dropped, "dropped_samples")):
            total = _num(doc.get(key))
            if total is not None:
                fam.add_metric([src, ENDED], max(0.0, total - sum(_num(st.get(key)) or 0.0 for st in live.values())))
    yield from (lost, dropped, backlog, oldest, datagrams)


def families(health: Mapping[str, Any], pipeline: Any) -> Iterator[Any]:
    """Metric families from one health document and the pipeline's histograms (pure over its inputs)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
        StateSetMetricFamily,
    )

    versions = health.get("versions") or {}
    yield InfoMetricFamily(f"{NS}_build", "Agent and runtime versions",
                           value={**{k: str(v) for k, v in versions.items()}, "device_id": str(health.get("device_id"))})
    yield GaugeMetricFamily(f"{NS}_uptime_seconds", "Seconds since the agent started", value=health.get("uptime_s", 0))
    yield GaugeMetricFamily(f"{NS}_serving", "1 while a proven candidate serves frames", value=int(bool(health.get("serving"))))
    yield GaugeMetricFamily(f"{NS}_paused", "1 while serving is paused by command", value=int(bool(health.get("paused"))))

    # frames, per source: counters since the pipeline started (a reload starts them again: Prometheus sees a reset)
    src = (health.get("source") or {}).get("name")
    pipe = health.get("pipeline") or {}
    if src is not None and pipe:
        for name, key, doc in (("frames_in", "frames_in", "Frames the source delivered"),
                               ("frames_out", "frames_out", "Results published"),
                               ("frames_dropped", "dropped", "Frames dropped by latest-frame-wins hand-over"),
                               ("frames_bad", "bad_frames", "Frames that could not be decoded or preprocessed"),
                               ("inference_errors", "inference_errors", "Inference calls that failed or gave non-finite outputs")):
            c = CounterMetricFamily(f"{NS}_{name}", doc, labels=["source"])
            c.add_metric([src], pipe.get(key, 0))
            yield c
        st = health.get("source") or {}
        c = CounterMetricFamily(f"{NS}_source_reconnects", "Times the source was reopened", labels=["source"])
        c.add_metric([src], st.get("reconnects", 0))
        yield c
        if _num(st.get("last_frame_age_s")) is not None:
            g = GaugeMetricFamily(f"{NS}_source_last_frame_age_seconds", "Seconds since the last frame", labels=["source"])
            g.add_metric([src], st["last_frame_age_s"])
            yield g
    yield from _stream_families(health)
    stages = pipe.get("stages") or {}
    if stages:  # how the pipeline sized its pools, and what each stage measurably costs per frame
        w = GaugeMetricFamily(f"{NS}_stage_threads", "Threads the pipeline gave each pool", labels=["stage"])
        for stage in ("preprocess", "inference"):
            w.add_metric([stage], stages.get(f"{stage}_workers", 0))
        yield w
        costs = stages.get("costs") or {}
        cpu = GaugeMetricFamily(f"{NS}_stage_cpu_seconds_per_frame", "CPU time per frame of each stage, measured at start",
                                labels=["stage"])
        for stage in ("capture", "preprocess", "inference", "publish"):
            if _num(costs.get(f"{stage}_ms")) is not None:
                cpu.add_metric([stage], costs[f"{stage}_ms"] / 1000)
        yield cpu
        if _num(stages.get("pace_fps")) is not None:
            g = GaugeMetricFamily(f"{NS}_pipeline_pace_fps", "Frames per second the slowest stage allows",
                                  labels=["bottleneck"])
            g.add_metric([str(stages.get("bottleneck"))], stages["pace_fps"])
            yield g
    if pipeline is not None:
        h = HistogramMetricFamily(f"{NS}_stage_latency_seconds", "Per-frame latency of each pipeline stage",
                                  labels=["stage"])
        for stage, hist in pipeline.histograms_ms.items():
            buckets, total_ms = hist.cumulative()
            h.add_metric([stage], [("+Inf" if b == float("inf") else f"{b / 1000:g}", n) for b, n in buckets],
                         total_ms / 1000)
        yield h

    # what serves, and the self-test that proved it (the figures health and the report page show)
    provider = health.get("provider") or {}
    bundle = health.get("bundle") or {}
    sel = GaugeMetricFamily(f"{NS}_selected_candidate", "1 for the candidate that serves",
                            labels=["bundle", "version", "variant", "provider", "effective_provider"])
    if health.get("variant") is not None:
        sel.add_metric([str(bundle.get("bundle")), str(bundle.get("version")), str(health["variant"]),
                        str(provider.get("requested")), str((provider.get("effective") or [""])[0])], 1)
    yield sel
    fig = health.get("selftest") or {}
    if fig:
        b = fig.get("bundle") or {}
        g = GaugeMetricFamily(f"{NS}_selftest_passed", "1 when the last self-test passed clean (0 when nothing "
                              "passed or what serves is degraded: edge_agent_selftest_verdict says which)",
                              labels=["bundle", "version"])
        said = fig.get("verdict") or ("pass" if fig.get("passed") else "fail")  # an older health: `passed` only
        g.add_metric([str(b.get("name")), str(b.get("version"))], int(said == "pass"))
        yield g
        word = GaugeMetricFamily(f"{NS}_selftest_verdict", "1 for the proof's verdict: pass, degraded (serving, "
                                 "too slow, drifted or pinned below floor) or fail", labels=["verdict"])
        for v in VERDICTS:
            word.add_metric([v], int(said == v))
        yield word
        if _num(fig.get("created_ts")) is not None:
            yield GaugeMetricFamily(f"{NS}_selftest_last_run_timestamp_seconds",
                                    "When the last self-test ran (Unix time)", value=fig["created_ts"])
        verdict = GaugeMetricFamily(f"{NS}_selftest_candidate_passed", "1 when the candidate passed its self-test",
                                    labels=["provider", "variant", "verdict"])
        p95 = GaugeMetricFamily(f"{NS}_selftest_latency_p95_seconds", "Self-test p95 latency of the candidate",
                                labels=["provider", "variant"])
        budget = GaugeMetricFamily(f"{NS}_selftest_latency_budget_seconds", "The p95 budget it was judged against",
                                   labels=["provider", "variant"])
        ratio = GaugeMetricFamily(f"{NS}_selftest_provider_node_ratio",
                                  "Fraction of graph nodes placed on the candidate's own provider",
                                  labels=["provider", "variant"])
        for c in fig.get("candidates") or ():
            prov, _, variant = str(c.get("key", ":")).partition(":")
            verdict.add_metric([prov, variant, str(c.get("verdict"))], int(c.get("verdict") == "pass"))
            for fam, key, scale in ((p95, "p95_ms", 1e-3), (budget, "budget_ms", 1e-3), (ratio, "provider_fraction", 1.0)):
                if _num(c.get(key)) is not None:
                    fam.add_metric([prov, variant], c[key] * scale)
        yield from (verdict, p95, budget, ratio)
    yield from _verdict_families(health, fig)

    outbox = health.get("outbox") or {}
    if outbox:
        for name, key, doc in (("outbox_depth_messages", "depth", "Messages waiting to be acknowledged (memory and disk)"),
                               ("outbox_on_disk_messages", "on_disk", "Messages spilled to disk"),
                               ("outbox_inflight_messages", "inflight", "QoS 1 messages awaiting PUBACK"),
                               ("outbox_oldest_age_seconds", "oldest_age_s", "Age of the oldest waiting message")):
            yield GaugeMetricFamily(f"{NS}_{name}", doc, value=outbox.get(key, 0))
        for name, key, doc in (("outbox_dropped_messages", "dropped", "Messages the outbox policy dropped"),
                               ("outbox_sent_messages", "sent", "Messages handed to the broker client"),
                               ("outbox_acked_messages", "acked", "Messages the broker acknowledged")):
            yield CounterMetricFamily(f"{NS}_{name}", doc, value=outbox.get(key, 0))
    mqtt = health.get("mqtt")
    if mqtt is not None:
        yield GaugeMetricFamily(f"{NS}_mqtt_connected", "1 while connected to the broker",
                                value=int(bool(mqtt.get("connected"))))
    state = str((health.get("update") or {}).get("state") or "idle")
    states = UPDATE_STATES if state in UPDATE_STATES else (*UPDATE_STATES, state)
    yield StateSetMetricFamily(f"{NS}_update_state", "The bundle update's current (or last) state",
                               value={s: s == state for s in states})


class _Collector:
    def __init__(self, agent: MetricsSource):
        self.agent = agent  # the controller (or a test's stand-in): health and pipeline metrics, never frames

    def collect(self) -> Iterator[Any]:
        try:
            # the controller's last published health document, never its live state read from this HTTP
            # thread (a source without snapshots, e.g. a test's, is asked for its health)
            snapshot = getattr(self.agent, "health_snapshot", None)
            health = snapshot() if snapshot is not None else self.agent.health()
            getter = getattr(self.agent, "pipeline_metrics", None)
            pipeline = getter() if getter is not None else getattr(getattr(self.agent, "pipeline", None), "metrics", None)
        except Exception as exc:  # a scrape must not take the agent down; the failure is counted by the scraper
            log.error("metrics.collect_failed", error=f"{type(exc).__name__}: {exc}")
            return
        yield from families(health, pipeline)


@dataclass
class MetricsServer:
    host: str
    port: int
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(listen: str | None, source: MetricsSource, live: Any = None) -> MetricsServer | None:
    """Serve /metrics on `listen` ("HOST:PORT"); None (and nothing imported) when it is unset. `live`: an
    `agent.link.liveview.LiveView` whose /live pages the same listener serves beside /metrics."""
    if not listen:
        return None
    host, port = parse_listen(listen)
    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector
    except ImportError as exc:
        raise AgentError("metrics.listen is set but prometheus_client is not installed: "
                         + install_hint("metrics", "prometheus-client")) from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
    try:
        if live is None:
            server, thread = start_http_server(port, host, registry=registry)
        else:
            server, thread = _serve_with_live(host, port, registry, live)
    except OSError as exc:
        raise AgentError(f"metrics.listen {listen}: cannot listen: {exc.strerror or exc}") from exc
    log.info("metrics.listening", listen=f"{host}:{port}", path="/metrics", live_view="/live" if live else None)
    return MetricsServer(host, port, server, thread)


def _serve_with_live(host: str, port: int, registry: Any, live: Any) -> tuple[Any, threading.Thread]:
    """prometheus_client's own threaded WSGI server and /metrics app, with /live routed to the live view."""
    from wsgiref.simple_server import make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

    server = make_server(host, port, live.wsgi(make_wsgi_app(registry)), ThreadingWSGIServer,
                         handler_class=_SilentHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread


def _verdict_families(health: Mapping[str, Any], fig: Mapping[str, Any]) -> Iterator[Any]:
    """Loud states (a pinned below-floor or degraded candidate) and the serving audit's counters."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    audit = health.get("audit") or {}
    yield GaugeMetricFamily(f"{NS}_pinned_below_floor", "1 while a pinned candidate serves below its authored floor",
                            value=int(bool(fig.get("pinned_below_floor"))))
    deg = GaugeMetricFamily(f"{NS}_degraded", "1 while serving degraded, by reason", labels=["reason"])
    deg.add_metric(["too_slow"], int(bool(fig.get("degraded"))))
    deg.add_metric(["audit_drift"], int(audit.get("state") == "degraded"))
    deg.add_metric(["slow_serving"], int(bool(audit.get("slow"))))
    yield deg
    for name, key, doc in (("audit_canary_runs", "canary_runs", "Golden canaries run through the live session"),
                           ("audit_canary_failures", "canary_failures", "Canaries that did not reproduce"),
                           ("audit_live_samples", "live_samples", "Live frames re-run through the reference"),
                           ("audit_live_windows", "live_windows", "Live-audit windows judged"),
                           ("audit_live_drift", "live_drift", "Live-audit windows under the fidelity floors")):
        yield CounterMetricFamily(f"{NS}_{name}", doc, value=audit.get(key, 0) or 0)
    # the last audit: when each check last ran and whether it held (no sample before its first run)
    last = audit.get("last") or {}
    when = GaugeMetricFamily(f"{NS}_audit_last_check_timestamp_seconds", "When the audit's check last ran",
                             labels=["check"])
    held = GaugeMetricFamily(f"{NS}_audit_last_check_passed", "1 when the audit's last check held, 0 when not",
                             labels=["check"])
    for check in ("canary", "live"):
        one = last.get(check) if isinstance(last, Mapping) else None
        if isinstance(one, Mapping) and isinstance(one.get("at_unix"), (int, float)):
            when.add_metric([check], float(one["at_unix"]))
            held.add_metric([check], int(bool(one.get("passed"))))
    yield when
    yield held
