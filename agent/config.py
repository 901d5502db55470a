"""The agent's YAML config -> typed, validated settings.

The dataclasses below (and each source type's class, in agent.source_types) are the one definition of
every key: its type, default, range and meaning (`Key`). `agent.config_schema` makes the JSON Schema the YAML is validated with from them, and the
reference table in docs/reference/config.md is generated from the same schema. Every error names the
file, the key path, what was expected and what was found; unknown keys are errors, never ignored
(a typo in `allow_cpu_falback` must not change what the agent does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml

from agent.config_schema import build, validate
from agent.fsio import load_yaml
from agent.errors import ConfigError, PayloadError
from agent.keydoc import Key
from agent.proof.selection import SelectionPolicy
from agent.proof.terms import DEFAULT_ORDER, SessionSettings
# One config class per source type (agent.source_types: a module each, a registry by `type`); the schema
# makes `source:` their discriminated union. `SourceConfig(type=...)` builds the registered class of the type.
from agent.source_types import PathKey, SourceConfig


@dataclass(frozen=True)
class ProvidersConfig:
    order: Annotated[tuple[str, ...], Key("providers in priority order; any provider name works")] = DEFAULT_ORDER
    options: Annotated[Mapping[str, Mapping[str, str]], Key(
        "per provider, its options, e.g. {OpenVINOExecutionProvider: {device_type: CPU}}")] = field(default_factory=dict)


_POLICY = SelectionPolicy()  # the selection defaults are the proof's own: defined once, in SelectionPolicy


@dataclass(frozen=True)
class SelectionConfig:
    provider: Annotated[str | None, Key("pin a provider")] = None
    variant: Annotated[str | None, Key("pin a variant")] = None
    allow_cpu_fallback: Annotated[bool, Key("false: refuse to serve on the CPU provider")] = _POLICY.allow_cpu_fallback
    prefer_margin: Annotated[float, Key("the bundle's preferred variant wins unless another passing one is at least "
                                        "this much faster (p50)", ge=0, le=10)] = _POLICY.prefer_margin
    use_cache: Annotated[bool, Key("reuse a cached verdict (reproduction and fidelity re-checked)")] = True
    latency_retries: Annotated[int, Key("renewed latency measurements when only latency failed (a busy machine)",
                                        ge=0)] = _POLICY.latency_retries
    latency_backoff_s: Annotated[float, Key("the first wait before a latency re-measurement; it doubles each time "
                                            "(capped at 60 s)", ge=0)] = _POLICY.latency_backoff_s
    when_too_slow: Annotated[Literal["degraded", "none"], Key(
        "after the retries: none serves nothing, degraded serves the fastest proven candidate, loudly")] = \
        _POLICY.when_too_slow
    reproof_backoff_s: Annotated[float, Key("nothing serves only because of latency: prove again while up after this "
                                            "long, doubling (agent.service.reproof); 0: off", ge=0)] = 30.0
    reproof_max_backoff_s: Annotated[float, Key("the longest wait between re-proofs", ge=0)] = 900.0


@dataclass(frozen=True)
class PipelineConfig:
    max_batch: Annotated[int, Key("micro-batching where the model has a dynamic batch dimension", ge=1)] = 1
    batch_timeout_ms: Annotated[float, Key("how long a batch waits to fill", ge=0)] = 2.0
    queue_size: Annotated[int, Key("bounded queues between stages", ge=1)] = 2
    inference_workers: Annotated[int, Key("threads calling run() on the one session; 0: sized at start from measured "
                                          "costs (at most the cores, and 4)", ge=0, le=64)] = 0
    preprocess_workers: Annotated[int, Key("threads decoding deferred JPEGs and preprocessing (fused: and running the "
                                           "model); 0: sized at start", ge=0, le=64)] = 0
    stage_layout: Annotated[Literal["auto", "fused", "pools"], Key(
        "fused: each worker preprocesses and runs the model; pools: separate pools; auto: fused on the CPU "
        "provider unless inference_workers is set")] = "auto"
    max_frames: Annotated[int, Key("stop after this many frames (0: run until stopped)", ge=0)] = 0
    batch_across_sources: Annotated[bool, Key("many sources, dynamic batch: batch up to one frame per source")] = True


@dataclass(frozen=True)
class OutputConfig:
    stdout: Annotated[bool, Key("results as JSON lines on stdout")] = True
    health_interval_s: Annotated[float, Key("how often health is logged (and published, with MQTT)", ge=0.1)] = 10.0
    max_result_bytes: Annotated[int, Key("a decoded result over this many bytes of JSON is counted in result_errors "
                                         "and not published (0: no cap)", ge=0)] = 65536


@dataclass(frozen=True)
class TlsConfig:
    ca_file: Annotated[Path | None, Key("CA that signed the broker's certificate (verification is always on unless "
                                        "insecure)")] = None
    cert_file: Annotated[Path | None, Key("client certificate")] = None
    key_file: Annotated[Path | None, Key("client key")] = None
    insecure: Annotated[bool, Key("skip certificate verification: development only")] = False


@dataclass(frozen=True)
class MqttConfig:
    enabled: Annotated[bool, Key("connect to a broker: predictions, health, commands, updates")] = False
    host: Annotated[str, Key("the broker")] = "127.0.0.1"
    port: Annotated[int, Key("the broker's port", ge=1, le=65535)] = 1883
    protocol: Annotated[Literal["5", "3.1.1"], Key("MQTT protocol version")] = "5"
    client_id: Annotated[str | None, Key("the MQTT client id", default_doc="edge-agent-<device_id>")] = None
    keepalive: Annotated[int, Key("seconds", ge=1)] = 30
    clean_start: Annotated[bool, Key("start a new session at every connect")] = False
    session_expiry_s: Annotated[int, Key("MQTT 5: how long the broker keeps our session while we are away",
                                         ge=0)] = 3600
    qos: Annotated[Literal[0, 1], Key("QoS of predictions")] = 1
    prefix: Annotated[str | None, Key("topic prefix", default_doc="edge/<device_id>/")] = None
    username: Annotated[str | None, Key("broker user name")] = None
    password: Annotated[str | None, Key("broker password (prefer password_file or password_env)", secret=True)] = None
    password_file: Annotated[Path | None, Key("a file holding the password")] = None
    password_env: Annotated[str | None, Key("an environment variable holding the password")] = None
    tls: Annotated[TlsConfig | None, Key("TLS to the broker")] = None
    reconnect_min_s: Annotated[int, Key("first reconnect wait", ge=1)] = 1
    reconnect_max_s: Annotated[int, Key("longest reconnect wait", ge=1)] = 30
    max_inflight: Annotated[int, Key("QoS 1 messages awaiting PUBACK at once", ge=1)] = 100
    batch_predictions: Annotated[int, Key("results per predictions message (1: one message per result)", ge=1)] = 1
    homeassistant: Annotated[bool, Key("Home Assistant MQTT discovery")] = False
    homeassistant_prefix: Annotated[str, Key("Home Assistant's discovery prefix")] = "homeassistant"
    max_payload_bytes: Annotated[int, Key("a command larger than this gets an error reply, unparsed", ge=256)] = \
        64 * 1024
    max_json_depth: Annotated[int, Key("a command nested deeper than this gets an error reply, unparsed", ge=2)] = 32
    reply_topics: Annotated[tuple[str, ...], Key("MQTT filters an MQTT 5 response topic may match besides "
                                                 "<prefix>reply/#")] = ()
    max_packet_bytes: Annotated[int, Key("MQTT 5 Maximum Packet Size: the broker drops bigger messages before they "
                                         "reach the agent; must hold a bundle chunk and its topic", ge=1024)] = \
        5 * 2**20


@dataclass(frozen=True)
class OutboxConfig:
    memory_messages: Annotated[int, Key("held in memory while the broker keeps up; beyond, spill to disk", ge=1)] = 5000
    max_messages: Annotated[int, Key("memory + disk; beyond, the policy drops (counted in health)", ge=1)] = 1_000_000
    max_age_s: Annotated[float, Key("older messages are dropped (counted)", ge=1)] = 7 * 86400.0
    policy: Annotated[Literal["drop_oldest", "drop_newest"], Key("what a full outbox drops")] = "drop_oldest"


@dataclass(frozen=True)
class UpdatesConfig:
    """Pushed bundles: verified, self-tested in a child process, switched, on probation, committed."""

    enabled: Annotated[bool, Key("serve from the bundle store (state_dir/store) and accept updates; bundle seeds "
                                 "it")] = False
    trusted_keys: Annotated[tuple[Path, ...], Key("Ed25519 public keys (PEM); several for key rotation")] = ()
    allow_unsigned: Annotated[bool, Key("accept unsigned bundles: development only, logged loudly")] = False
    keep: Annotated[int, Key("committed bundles kept for rollback", ge=1)] = 3
    probation_s: Annotated[float, Key("a new bundle serves this long ...", ge=0)] = 20.0
    probation_frames: Annotated[int, Key("... or this many frames with no errors and latency in budget", ge=0)] = 100
    max_bundle_bytes: Annotated[int, Key("archive and unpacked size limit", ge=1024)] = 512 * 2**20
    selftest_timeout_s: Annotated[float, Key("how long a self-test step may go without progress before it is a hang "
                                             "(no cap on a slow child that progresses)", ge=1)] = 300.0
    inbox: Annotated[Path | None, Key("a directory watched for dropped .tar.gz bundles")] = None
    download_timeout_s: Annotated[float, Key("URL delivery: one read may wait this long", ge=1)] = 60.0
    download_deadline_s: Annotated[float, Key("URL delivery: the whole download must finish within this",
                                              ge=1)] = 600.0
    allow_http: Annotated[bool, Key("http beyond loopback (127.0.0.1, ::1, localhost); https always")] = False
    min_chunk_bytes: Annotated[int, Key("an offer's chunk_size must lie in [min, max]: bounds the chunk count",
                                        ge=1)] = 1024
    max_chunk_bytes: Annotated[int, Key("the largest chunk an offer may announce", ge=1)] = 4 * 2**20
    min_free_bytes: Annotated[int, Key("a delivered bundle (offer, URL, inbox) must leave this much disk free "
                                       "(after 2x its size)", ge=0)] = \
        64 * 2**20
    transfer_idle_s: Annotated[float, Key("a transfer with no message for this long expires; staging is swept",
                                          ge=1)] = 60.0


@dataclass(frozen=True)
class MetricsConfig:
    listen: Annotated[str | None, Key("HOST:PORT for Prometheus /metrics, e.g. 127.0.0.1:9108 (needs the extra "
                                      "metrics); off when unset")] = None
    live_view: Annotated[bool, Key("also serve /live on metrics.listen: the latest frame of each source with its "
                                   "served result drawn, beside the verdict, health, audit and latency "
                                   "(agent.link.liveview)")] = False


@dataclass(frozen=True)
class LogConfig:
    level: Annotated[Literal["debug", "info", "warning", "error"], Key("log level")] = "info"
    json: Annotated[bool | None, Key("JSON lines (true) or key=value (false)", default_doc="auto: JSON unless "
                                     "stderr is a terminal")] = None


@dataclass(frozen=True)
class AuditConfig:
    """Proving while serving (agent.service.audit): a golden sample through the live session every
    `canary_period_s`, and a live frame re-run through the reference variant on the CPU every
    `live_period_s`, judged `live_window` frames at a time; drift marks health degraded and re-proves."""

    enabled: Annotated[bool, Key("keep proving while serving: the golden canary and the live audit")] = True
    canary_period_s: Annotated[float, Key("a golden sample through the live session this often", ge=0.1)] = 60.0
    live_period_s: Annotated[float, Key("a live frame re-run through the reference variant on the CPU this often",
                                        ge=0.1)] = 30.0
    live_window: Annotated[int, Key("live frames judged together by the task's fidelity floors", ge=1)] = 8
    reference: Annotated[str, Key("the reference variant of the live audit")] = "fp32"
    switch_on_drift: Annotated[bool, Key("on drift, serve the next proven candidate (its proof's report, or a "
                                         "reload's proof when the report has none); false: keep serving it, "
                                         "flagged, and run a self-test")] = True
    evidence_ttl_s: Annotated[float, Key("how long a drift found while serving keeps its candidate from being "
                                         "selected (a golden-only re-proof does not clear it)", ge=0)] = 86400.0
    slow_factor: Annotated[float, Key("serving latency this many times the proven p50, sustained, is reported "
                                      "(audit.slow)", ge=1.0)] = 3.0
    slow_period_s: Annotated[float, Key("how long serving latency must stay over audit.slow_factor x the "
                                        "proven p50 to be reported", ge=1.0)] = 30.0


SERVICE_STATE_DIR = Path("/var/lib/edge-agent")
TOPIC_LEVEL = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # one MQTT topic level: no / + # or spaces


def user_state_dir() -> Path:
    """Where a user's commands keep state when the config names no state_dir. Only the service's own config
    (systemd/agent.yaml, installed by install.sh) sets /var/lib/edge-agent: a CLI run as root must never
    overwrite the installed service's report, verdict cache or store."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edge-agent"


@dataclass(frozen=True)
class Config:
    device_id: Annotated[str, Key("this device's name: one MQTT topic level, the client id, results (letters, digits, "
                                  "_ . -; at most 64: no / + # that would widen a topic filter)",
                                  default_doc="host name", pattern=TOPIC_LEVEL)] = \
        field(default_factory=socket.gethostname)
    state_dir: Annotated[Path, Key("self-test report, crash ledger, verdict cache, store, outbox; --state-dir "
                                   "overrides it for one command",
                                   default_doc="$XDG_STATE_HOME/edge-agent (else ~/.local/state/edge-agent)")] = \
        field(default_factory=user_state_dir)
    bundle: Annotated[Path | None, Key("the bundle directory to serve (with updates: seeds the store)")] = None
    providers: ProvidersConfig = ProvidersConfig()
    selection: SelectionConfig = SelectionConfig()
    session: SessionSettings = SessionSettings()
    source: Annotated[SourceConfig, Key("the one source (or sources:)")] = SourceConfig()
    # many sources served by one proven session: each with its own name (results, topics, health), type,
    # rate limit, lossless policy and reconnect state; `source:` is the one-source form of the same thing
    sources: Annotated[tuple[SourceConfig, ...], Key("many sources served by one proven session, each a source: "
                                                     "mapping with a unique name; instead of source")] = ()
    pipeline: PipelineConfig = PipelineConfig()
    output: OutputConfig = OutputConfig()
    mqtt: MqttConfig = MqttConfig()
    outbox: OutboxConfig = OutboxConfig()
    updates: UpdatesConfig = UpdatesConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    audit: AuditConfig = AuditConfig()
    labels: Annotated[Mapping[str, str], Key("what a fleet rollout targets on (site, camera, group): published in "
                                             "the retained facts topic")] = field(default_factory=dict)
    source_file: Annotated[Path | None, Key("(set by the loader: the file this config came from)")] = None

    @property
    def source_list(self) -> tuple[SourceConfig, ...]:
        """Every source this agent serves: the `sources:` list, or the one `source:`."""
        return self.sources or (self.source,)


def parse_config(text: str, where: str) -> Config:
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: malformed YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level, found {type(data).__name__}")
    if "source_file" in data:
        raise ConfigError(f"{where}: key source_file: unknown key")
    if "source" in data and "sources" in data:
        raise ConfigError(f"{where}: keys source and sources: give one source (source:) or a list (sources:), not both")
    validate(data, where)
    cfg = build(Config, data)
    base = Path(where).parent

    def anchored(p: Path | None) -> Path | None:
        # Relative paths in a config file are relative to that file, not to the working directory.
        return p if p is None or p.is_absolute() else base / p

    return _checked(dataclasses.replace(
        cfg,
        state_dir=anchored(cfg.state_dir),
        bundle=anchored(cfg.bundle),
        source=_anchored_source(cfg.source, base),
        sources=tuple(_anchored_source(c, base) for c in cfg.sources),
        mqtt=dataclasses.replace(
            cfg.mqtt,
            password_file=anchored(cfg.mqtt.password_file),
            tls=None if cfg.mqtt.tls is None else dataclasses.replace(
                cfg.mqtt.tls, ca_file=anchored(cfg.mqtt.tls.ca_file), cert_file=anchored(cfg.mqtt.tls.cert_file),
                key_file=anchored(cfg.mqtt.tls.key_file)),
        ),
        updates=dataclasses.replace(
            cfg.updates, inbox=anchored(cfg.updates.inbox),
            trusted_keys=tuple(anchored(k) for k in cfg.updates.trusted_keys)),
        source_file=Path(where),
    ), where)


def _anchored_source(src: SourceConfig, base: Path) -> SourceConfig:
    return src.under(base) if isinstance(src, PathKey) else src


def _checked(cfg: Config, where: str) -> Config:
    check_semantics(cfg, where)
    return cfg


SOURCE_NAME = re.compile(TOPIC_LEVEL)


def check_sources(cfg: Config, where: str) -> None:
    """`sources:` entries each need a name that is unique and usable as a topic level (predictions/<name>)."""
    seen: set[str] = set()
    for i, s in enumerate(cfg.sources):
        if not s.name:
            raise ConfigError(f"{where}: key sources[{i}].name: every listed source needs a name "
                              f"(it tags results and names its topic predictions/<name>)")
        if not SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(f"{where}: key sources[{i}].name: {s.name!r} is not a topic level "
                              f"(letters, digits, _ . -; at most 64; no / + # or spaces)")
        if s.name in seen:
            raise ConfigError(f"{where}: key sources[{i}].name: {s.name!r} names two sources")
        seen.add(s.name)


def check_semantics(cfg: Config, where: str) -> None:
    """What a schema cannot say: keys that must agree with each other (ranges are on the fields)."""
    check_sources(cfg, where)
    if cfg.updates.min_chunk_bytes > cfg.updates.max_chunk_bytes:
        raise ConfigError(f"{where}: key updates.min_chunk_bytes: {cfg.updates.min_chunk_bytes} is over "
                          f"updates.max_chunk_bytes {cfg.updates.max_chunk_bytes}")
    if cfg.mqtt.max_packet_bytes < max(cfg.updates.max_chunk_bytes, cfg.mqtt.max_payload_bytes) + 1024:
        raise ConfigError(f"{where}: key mqtt.max_packet_bytes: {cfg.mqtt.max_packet_bytes} cannot carry a chunk of "
                          f"updates.max_chunk_bytes {cfg.updates.max_chunk_bytes} (or a command of "
                          f"mqtt.max_payload_bytes) plus 1024 bytes of headers")
    if cfg.pipeline.stage_layout == "fused" and cfg.pipeline.inference_workers:
        raise ConfigError(f"{where}: key pipeline.inference_workers: {cfg.pipeline.inference_workers} has no effect "
                          f"with pipeline.stage_layout: fused (each worker runs the model: size them with "
                          f"pipeline.preprocess_workers, or use stage_layout: pools)")


def load_config(path: Path | str) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    return parse_config(text, str(path))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Effective settings as plain data (for `config check` and reports)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    return plain(cfg)


SECRET_KEYS = ("password",)


def masked(doc: dict[str, Any]) -> dict[str, Any]:
    """The same settings with secrets replaced by "***" (for printing and reports)."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out[k] = masked(v)
        elif k in SECRET_KEYS and v is not None:
            out[k] = "***"
        else:
            out[k] = v
    return out


# -- bounded JSON from the outside -----------------------------------------------------------------------
def json_depth_exceeds(data: bytes, max_depth: int) -> bool:
    """True when brackets nest deeper than max_depth (strings skipped): checked before json.loads recurses."""
    depth = 0
    in_string = escaped = False
    for b in data:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > max_depth:
                return True
        elif b in (0x5D, 0x7D):
            depth -= 1
    return False


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range for a finite float")
    return value


def parse_json_object(payload: bytes, max_bytes: int, max_depth: int = 32) -> dict[str, Any]:
    """An empty payload is {}; anything else must be a JSON object within the size and depth bounds."""
    if len(payload) > max_bytes:
        raise PayloadError(f"payload of {len(payload)} bytes is over the {max_bytes} byte limit")
    if not payload.strip():
        return {}
    if json_depth_exceeds(payload, max_depth):
        raise PayloadError(f"JSON nested deeper than {max_depth} levels")
    try:
        doc = json.loads(payload.decode("utf-8"), parse_constant=_not_json, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PayloadError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise PayloadError("the payload must be a JSON object")
    return doc
