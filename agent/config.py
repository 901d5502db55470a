"""The agent's YAML config -> typed, validated settings.

Every error names the file, the key path, what was expected and what was found. Unknown keys are
errors, not silently ignored: a typo in `allow_cpu_falback` must not change what the agent does.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import os
import re
import socket
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from agent.errors import ConfigError
from agent.proof.terms import DEFAULT_ORDER, SessionSettings


@dataclass(frozen=True)
class ProvidersConfig:
    order: tuple[str, ...] = DEFAULT_ORDER
    options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class SelectionConfig:
    provider: str | None = None
    variant: str | None = None
    allow_cpu_fallback: bool = True
    # The bundle's preferred variant wins unless another passing one is at least this much faster (p50).
    prefer_margin: float = 0.10
    use_cache: bool = True
    # Latency that fails only because the machine is busy is measured again after backoff_s, doubling,
    # `latency_retries` times; a device that stays too slow then serves its fastest proven candidate,
    # loudly (`degraded`), or nothing (`none`).
    latency_retries: int = 3
    latency_backoff_s: float = 2.0
    when_too_slow: Literal["degraded", "none"] = "none"


SourceType = Literal["folder", "video", "camera", "stream", "udp", "file", "stdin", "mqtt"]


@dataclass(frozen=True)
class SourceConfig:
    """Where frames come from. `type` picks the source from the registry in `agent.sources`."""

    type: SourceType = "folder"
    path: Path | None = None          # folder: images; video: file; file: FIFO / character device
    url: str | None = None            # stream: http(s) MJPEG, rtsp://...
    device: str | None = None         # camera: index ("0") or /dev/videoN
    loop: bool = False                # folder/video: start again at the end
    lossless: bool | None = None      # None: lossless for folder/video/file, latest-frame-wins for live sources
    max_fps: float = 0.0              # folder/video: pace reading (0: as fast as the pipeline takes frames)
    open_timeout_ms: int = 5000
    read_timeout_ms: int = 3000
    stall_timeout_s: float = 5.0      # no new frame for this long: the stream is lost, reopen
    frozen_after: int = 30            # this many identical consecutive frames: report a frozen picture
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0
    host: str = "127.0.0.1"           # udp: bind address; mqtt: the broker
    port: int = 0                     # udp: bind port; mqtt: the broker's port (0: 1883)
    topic: str | None = None          # mqtt: where frames arrive
    payload: Literal["image", "npy", "raw"] = "image"  # mqtt: encoded image, .npy bytes, or raw frame bytes
    sample_dtype: Literal["float32", "int16", "uint8"] = "float32"  # sensor samples, little-endian
    hop: int = 0                      # sensor: samples between windows (0: the window length)
    name: str | None = None           # how results and health name this source (default: type:target)
    # JPEG sources (MJPEG streams and videos, .jpg folders, mqtt images): decode at 1/2, 1/4 or 1/8 of the
    # frame; auto: the smallest the bundle's resize allows; 1: always full size
    decode_scale: Literal["auto", 1, 2, 4, 8] = "auto"
    decoder_threads: int = 0          # video/stream/camera through FFmpeg: decoder threads (0: OpenCV's choice)
    hw_decode: Literal["none", "any", "vaapi", "d3d11", "mfx", "drm"] = "none"  # FFmpeg hardware decoding


@dataclass(frozen=True)
class PipelineConfig:
    max_batch: int = 1                # micro-batching where the model has a dynamic batch dimension
    batch_timeout_ms: float = 2.0
    queue_size: int = 2               # bounded queues between stages
    inference_workers: int = 0        # threads calling run() on the one session; 0: sized at start (at most 4)
    preprocess_workers: int = 0       # threads decoding deferred JPEGs and preprocessing; 0: sized at start
    stage_layout: Literal["auto", "fused", "pools"] = "auto"  # fused: a worker preprocesses and runs the model
    max_frames: int = 0               # stop after this many frames (0: run until stopped)
    batch_across_sources: bool = True  # many sources, dynamic batch: batch up to one frame per source


@dataclass(frozen=True)
class OutputConfig:
    stdout: bool = True               # results as JSON lines on stdout
    health_interval_s: float = 10.0   # how often health is logged (and published, with MQTT)
    max_result_bytes: int = 65536     # a decoded result over this is counted as an error, never published (0: no cap)


@dataclass(frozen=True)
class TlsConfig:
    ca_file: Path | None = None       # CA that signed the broker's certificate (verification is always on
    cert_file: Path | None = None     # unless insecure: true, for development only)
    key_file: Path | None = None
    insecure: bool = False


@dataclass(frozen=True)
class MqttConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 1883
    protocol: Literal["5", "3.1.1"] = "5"
    client_id: str | None = None      # default: edge-agent-<device_id>
    keepalive: int = 30
    clean_start: bool = False
    session_expiry_s: int = 3600      # MQTT 5: how long the broker keeps our session while we are away
    qos: Literal[0, 1] = 1            # predictions
    prefix: str | None = None         # default: edge/<device_id>/
    username: str | None = None
    password: str | None = None       # or, better, one of:
    password_file: Path | None = None
    password_env: str | None = None
    tls: TlsConfig | None = None
    reconnect_min_s: int = 1
    reconnect_max_s: int = 30
    max_inflight: int = 500           # QoS 1 messages awaiting PUBACK at once
    batch_predictions: int = 1        # results per predictions message (1: one message per result)
    homeassistant: bool = False       # Home Assistant MQTT discovery
    homeassistant_prefix: str = "homeassistant"
    # What one message may cost before it is parsed: commands larger or deeper are answered with an error.
    max_payload_bytes: int = 64 * 1024
    max_json_depth: int = 32
    # Replies go to <prefix>cmd/<name>/reply, or to an MQTT 5 response topic under <prefix>reply/;
    # any other response topic must match one of these filters (e.g. "operators/+/replies/#").
    reply_topics: tuple[str, ...] = ()
    max_running_commands: int = 4     # commands handled at once; beyond, the reply is "busy"
    # MQTT 5: the broker must not send us a packet bigger than this (it drops it): bounds what one message
    # can cost before any check of ours runs. Must hold a bundle chunk (updates.max_chunk_bytes) and its topic.
    max_packet_bytes: int = 5 * 2**20


@dataclass(frozen=True)
class OutboxConfig:
    memory_messages: int = 5000       # held in memory while the broker keeps up; beyond, spill to disk
    max_messages: int = 1_000_000     # memory + disk; beyond, the policy drops (counted in health)
    max_age_s: float = 7 * 86400.0
    policy: Literal["drop_oldest", "drop_newest"] = "drop_oldest"


@dataclass(frozen=True)
class UpdatesConfig:
    """Pushed bundles: verified, self-tested in a child process, switched, on probation, committed."""

    enabled: bool = False             # serve from the bundle store (state_dir/store); `bundle` seeds it
    trusted_keys: tuple[Path, ...] = ()  # Ed25519 public keys (PEM); several for key rotation
    allow_unsigned: bool = False      # development only: logged loudly
    keep: int = 3                     # committed bundles kept for rollback
    probation_s: float = 20.0         # a new bundle serves this long ...
    probation_frames: int = 100       # ... or this many frames with no errors, latency in budget
    max_bundle_bytes: int = 512 * 2**20
    selftest_timeout_s: float = 300.0
    inbox: Path | None = None         # a directory watched for dropped .tar.gz bundles
    download_timeout_s: float = 60.0  # one read may wait this long ...
    download_deadline_s: float = 600.0  # ... and the whole download must finish within this
    allow_http: bool = False          # http beyond loopback (127.0.0.1, ::1, localhost); https always
    min_chunk_bytes: int = 1024       # an offer's chunk_size must lie in [min, max]: bounds the chunk count
    max_chunk_bytes: int = 4 * 2**20
    min_free_bytes: int = 64 * 2**20  # an offer must leave this much disk free (after 2x its size)
    transfer_idle_s: float = 60.0     # a transfer with no message for this long expires; staging is swept


@dataclass(frozen=True)
class MetricsConfig:
    listen: str | None = None         # "127.0.0.1:9108": Prometheus /metrics (needs the extra `metrics`); off when unset


@dataclass(frozen=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool | None = None


SERVICE_STATE_DIR = Path("/var/lib/edge-agent")


def user_state_dir() -> Path:
    """Where a user's commands keep state when the config names no state_dir. Only the service's own config
    (systemd/agent.yaml, installed by install.sh) sets /var/lib/edge-agent: a CLI run as root must never
    overwrite the installed service's report, verdict cache or store."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edge-agent"


@dataclass(frozen=True)
class Config:
    device_id: str = field(default_factory=socket.gethostname)
    state_dir: Path = field(default_factory=user_state_dir)
    bundle: Path | None = None
    providers: ProvidersConfig = ProvidersConfig()
    selection: SelectionConfig = SelectionConfig()
    session: SessionSettings = SessionSettings()
    source: SourceConfig = SourceConfig()
    # many sources served by one proven session: each with its own name (results, topics, health), type,
    # rate limit, lossless policy and reconnect state; `source:` is the one-source form of the same thing
    sources: tuple[SourceConfig, ...] = ()
    pipeline: PipelineConfig = PipelineConfig()
    output: OutputConfig = OutputConfig()
    mqtt: MqttConfig = MqttConfig()
    outbox: OutboxConfig = OutboxConfig()
    updates: UpdatesConfig = UpdatesConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    source_file: Path | None = None

    @property
    def source_list(self) -> tuple[SourceConfig, ...]:
        """Every source this agent serves: the `sources:` list, or the one `source:`."""
        return self.sources or (self.source,)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: key {key}: {value!r} does not fit {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: key {key}: expected one of {list(args)}, found {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: key {key}: expected a list, found {type(value).__name__}")
        item = args[0]
        return tuple(_convert(item, v, where, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: key {key}: expected a mapping, found {type(value).__name__}")
        kt, vt = args if args else (str, Any)
        return {str(k): _convert(vt, v, where, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: key {key}: expected a mapping, found {type(value).__name__}")
        return build_dataclass(tp, value, where, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key {key}: expected true or false, found {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: key {key}: expected an integer, found {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: key {key}: expected a number, found {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: key {key}: expected a string, found {value!r}")
        return str(value)
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: key {key}: expected a path, found {value!r}")
        return Path(value)
    raise ConfigError(f"{where}: key {key}: unsupported setting type {_type_name(tp)}")


def build_dataclass(cls: Any, data: Mapping[str, Any], where: str, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        path = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: key {path}: unknown key (known here: {sorted(names)})")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, where, path)
    return cls(**kwargs)


def parse_config(text: str, where: str) -> Config:
    try:
        data = yaml.safe_load(text)
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
    cfg = build_dataclass(Config, data, where)
    base = Path(where).parent

    def anchored(p: Path | None) -> Path | None:
        # Relative paths in a config file are relative to that file, not to the working directory.
        return p if p is None or p.is_absolute() else base / p

    return _checked(dataclasses.replace(
        cfg,
        state_dir=anchored(cfg.state_dir),
        bundle=anchored(cfg.bundle),
        source=dataclasses.replace(cfg.source, path=anchored(cfg.source.path)),
        sources=tuple(dataclasses.replace(c, path=anchored(c.path)) for c in cfg.sources),
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


def _checked(cfg: Config, where: str) -> Config:
    check_ranges(cfg, where)
    return cfg


# (section, key, lowest allowed value): a value below it is refused at load, naming the key.
_MINIMUMS: tuple[tuple[str, str, float], ...] = (
    ("pipeline", "max_batch", 1), ("pipeline", "batch_timeout_ms", 0), ("pipeline", "queue_size", 1),
    ("pipeline", "inference_workers", 0), ("pipeline", "preprocess_workers", 0), ("pipeline", "max_frames", 0),
    ("output", "health_interval_s", 0.1),
    ("source", "max_fps", 0), ("source", "open_timeout_ms", 1), ("source", "read_timeout_ms", 1),
    ("source", "stall_timeout_s", 0.1), ("source", "frozen_after", 1), ("source", "reconnect_initial_s", 0),
    ("source", "reconnect_max_s", 0), ("source", "port", 0), ("source", "hop", 0),
    ("mqtt", "port", 1), ("mqtt", "keepalive", 1), ("mqtt", "session_expiry_s", 0), ("mqtt", "reconnect_min_s", 1),
    ("mqtt", "reconnect_max_s", 1), ("mqtt", "max_inflight", 1), ("mqtt", "batch_predictions", 1),
    ("mqtt", "max_payload_bytes", 256), ("mqtt", "max_json_depth", 2), ("mqtt", "max_running_commands", 1),
    ("outbox", "memory_messages", 1), ("outbox", "max_messages", 1), ("outbox", "max_age_s", 1),
    ("updates", "keep", 1), ("updates", "probation_s", 0), ("updates", "probation_frames", 0),
    ("updates", "max_bundle_bytes", 1024), ("updates", "selftest_timeout_s", 1), ("updates", "download_timeout_s", 1),
    ("updates", "download_deadline_s", 1), ("updates", "min_chunk_bytes", 1), ("updates", "max_chunk_bytes", 1),
    ("updates", "min_free_bytes", 0), ("updates", "transfer_idle_s", 1),
)
_MAXIMUMS: tuple[tuple[str, str, float], ...] = (
    ("mqtt", "port", 65535), ("source", "port", 65535), ("pipeline", "inference_workers", 64),
    ("pipeline", "preprocess_workers", 64),
    ("selection", "prefer_margin", 10.0),
)


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # one MQTT topic level: no / + # or spaces


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


MAX_DEVICE_ID_CHARS = 64


def check_device_id(device_id: str, where: str) -> None:
    """The device id is a topic level (edge/<id>/...) and the broker user name the ACL matches as %u: a '/'
    would split it, and '+' or '#' in a subscription filter would match other devices' commands."""
    bad = sorted({c for c in device_id if c in "/+#" or ord(c) < 0x20 or ord(c) == 0x7F or c.isspace()})
    if not device_id or len(device_id) > MAX_DEVICE_ID_CHARS or bad:
        why = ("is empty" if not device_id else f"is {len(device_id)} characters (at most {MAX_DEVICE_ID_CHARS})"
               if len(device_id) > MAX_DEVICE_ID_CHARS else f"contains {', '.join(repr(c) for c in bad)}")
        raise ConfigError(f"{where}: key device_id: {device_id[:80]!r} {why}; it names the device's MQTT topics and "
                          "broker account: use letters, digits, '-', '_' or '.' (no '/', '+', '#', spaces)")


def check_ranges(cfg: Config, where: str) -> None:
    """Refuse values that parse but cannot work (inference_workers: -3 would start no inference thread)."""
    sections = lambda section: ([(section, getattr(cfg, section))] if section != "source" else  # noqa: E731
                                [("source", cfg.source)] + [(f"sources[{i}]", s) for i, s in enumerate(cfg.sources)])
    for section, key, low in _MINIMUMS:
        for label, obj in sections(section):
            value = getattr(obj, key)
            if value < low:
                raise ConfigError(f"{where}: key {label}.{key}: expected >= {low:g}, found {value!r}")
    for section, key, high in _MAXIMUMS:
        for label, obj in sections(section):
            value = getattr(obj, key)
            if value > high:
                raise ConfigError(f"{where}: key {label}.{key}: expected <= {high:g}, found {value!r}")
    check_sources(cfg, where)
    check_device_id(cfg.device_id, where)
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
    if cfg.selection.prefer_margin < 0:
        raise ConfigError(f"{where}: key selection.prefer_margin: expected >= 0, found {cfg.selection.prefer_margin!r}")


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
class PayloadError(ValueError):
    """A message from outside is too large, too deep, not JSON or not a JSON object."""


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
