"""Every check `edge-agent run` makes before it serves, without the self-test: `config check` runs these, so a
config it calls OK does not fail at `run` (a missing or non-video source file, metrics without
prometheus_client, a state directory that cannot be written, an unreadable MQTT password file).

Each problem is one line naming the key, the path and the fix; notes are what a check here cannot decide.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import Config, SourceConfig
from agent.source_types import CameraSourceConfig, MqttSourceConfig, PathKey, PlaybackKeys, StreamSourceConfig
from agent.errors import AgentError, install_hint
from agent.proof.terms import CPU
from agent.service.boot import bundle_path_problem

if TYPE_CHECKING:
    from agent.bundle.load import Bundle



@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def state_dir_problem(path: Path) -> str | None:
    """Why `run` could not create or write `path` (it writes its boot counter, report and store there)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{path} cannot be created: {probe} is not a directory"
    if probe != path:
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{path} cannot be created: {probe} is not writable by this user"
        return _creatable(path, probe)
    try:  # a real write: access() says yes to root on a read-only bind mount on some kernels
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{path} is not writable by this user ({exc.strerror})"
    return None


def _creatable(path: Path, existing: Path) -> str | None:
    """Really create the first missing directory under `existing`, then take it away again: access() says yes for
    root under /sys and /proc, and on a read-only mount, where mkdir still fails (EPERM, EROFS, ENOENT)."""
    first = path
    while first.parent != existing:
        first = first.parent
    try:
        first.mkdir()
    except FileExistsError:
        return None  # made meanwhile (the agent itself): creatable
    except OSError as exc:
        return f"{path} cannot be created: {exc.strerror} (set state_dir to a directory this user can create)"
    try:
        first.rmdir()
    except OSError:
        pass  # something else wrote into it meanwhile: it exists, which is all `run` needs
    return None


def source_problems(cfg: Config) -> list[str]:
    """What `run` checks of its sources before the self-test (no bundle needed): a missing, unreadable or
    non-video file, a missing url or topic. A camera node may appear later (USB): only `config check` refuses
    one that is absent."""
    f = Findings()
    _check_sources(cfg, None, True, f, devices=False)
    return f.problems


def check(cfg: Config, installed_here: bool = True) -> Findings:
    """`installed_here` False: a template read before install.sh (paths it installs are notes, not problems)."""
    f = Findings()
    bundle = _check_bundle(cfg, installed_here, f)
    _check_selection(cfg, f)
    _check_sources(cfg, bundle, installed_here, f)
    why = state_dir_problem(cfg.state_dir)
    if why is not None:
        (f.problems if installed_here else f.notes).append(f"key state_dir: {why}")
    _check_metrics(cfg, f)
    _check_mqtt(cfg, installed_here, f)
    for k in cfg.updates.trusted_keys:
        if not k.exists() and installed_here:
            f.problems.append(f"key updates.trusted_keys: {k} does not exist")
    if cfg.updates.enabled and not cfg.updates.trusted_keys and not cfg.updates.allow_unsigned:
        f.notes.append("updates enabled with no trusted_keys: every pushed bundle will be refused")
    return f


def can_receive_bundle(cfg: Config) -> bool:
    """Whether a bundle can reach this agent while it runs: updates on, over MQTT (push, url) or an inbox."""
    return cfg.updates.enabled and (cfg.mqtt.enabled or cfg.updates.inbox is not None)


def _check_bundle(cfg: Config, installed_here: bool, f: Findings) -> Bundle | None:
    if cfg.bundle is None:
        if can_receive_bundle(cfg):
            f.notes.append("no bundle configured: the agent will run not serving until one is pushed")
        else:
            f.problems.append("key bundle: not set, and nothing could deliver one (updates.enabled is off, or has "
                              "neither mqtt.enabled nor updates.inbox): set bundle: to a bundle directory")
        return None
    if not installed_here and not cfg.bundle.exists():
        f.notes.append(f"bundle {cfg.bundle}: not installed here; checked when install.sh installs this config")
        return None
    why = bundle_path_problem(cfg.bundle)
    if why is not None:
        f.problems.append(f"key bundle: {why}")
        return None
    from agent.bundle.load import load_bundle

    try:
        b = load_bundle(cfg.bundle)
    except AgentError as exc:
        f.problems.append(f"key bundle: {exc}")
        return None
    f.notes.append(f"bundle {b.identity} loads: schema, file hashes and contracts verified")
    from agent.serving.sensors import stream_problems

    # a stateful bundle on a latest-frame-wins sensor source or unnumbered MQTT samples, a window the source cannot
    # fill, ...
    keys = [f"sources[{i}]" if cfg.sources else "source" for i in range(len(cfg.source_list))]
    f.problems += stream_problems(b.manifest.frame, b.manifest.inputs, cfg.source_list, keys)
    return b


def _check_selection(cfg: Config, f: Findings) -> None:
    """A CUDA (or any accelerator) pin with no CPU fallback on a machine that has no such provider serves nothing."""
    pin = cfg.selection.provider
    if pin is None or pin == CPU or cfg.selection.allow_cpu_fallback:
        return
    import onnxruntime as ort

    have = ort.get_available_providers()
    if pin not in have:
        f.problems.append(f"key selection.provider: {pin} is not in this onnxruntime build ({', '.join(have)}) and "
                          "selection.allow_cpu_fallback is false: nothing could serve; install its onnxruntime "
                          "package, or set allow_cpu_fallback: true")


def _camera_problem(device: str | None) -> str | None:
    """A camera index or /dev/video* path with no such node here (V4L2: index N is /dev/videoN)."""
    dev = device or "0"
    node = Path(f"/dev/video{dev}") if dev.isdigit() else Path(dev)
    if not str(node).startswith("/dev/") or node.exists():
        return None
    have = sorted(str(p) for p in Path("/dev").glob("video*"))
    return (f"{node} does not exist (this machine has {', '.join(have) if have else 'no /dev/video* node'}): plug "
            "the camera in, or set source.device to one that is there")


def _check_sources(cfg: Config, bundle: Bundle | None, installed_here: bool, f: Findings,
                   devices: bool = True) -> None:
    from agent.serving.source_checks import video_problem

    for i, src in enumerate(cfg.source_list):
        key = f"sources[{i}]" if cfg.sources else "source"
        if isinstance(src, PathKey):
            if src.path is None:
                f.problems.append(f"key {key}.path: source type {src.type} needs a path")
                continue
            if not src.path.exists():
                if installed_here:
                    f.problems.append(f"key {key}.path: {src.path} does not exist")
                else:
                    f.notes.append(f"{key}.path {src.path}: not installed here")
                continue
            if src.type == "folder" and not src.path.is_dir():
                f.problems.append(f"key {key}.path: {src.path} is not a directory")
                continue
            if not os.access(src.path, os.R_OK):
                f.problems.append(f"key {key}.path: {src.path} is not readable by this user")
                continue
            if src.type == "video" and (why := video_problem(src.path)) is not None:
                f.problems.append(f"key {key}.path: {why}")
                continue
            # recorded frames (a folder, a video) are opened here as `run` opens them, without side effects; a
            # camera, a stream, a port or a broker only by `run` itself (a check must not grab what it holds)
            if isinstance(src, PlaybackKeys) and bundle is not None:
                _try_open(key, src, bundle, f)
        elif isinstance(src, StreamSourceConfig) and not src.url:
            f.problems.append(f"key {key}.url: source type stream needs a url")
        elif isinstance(src, MqttSourceConfig) and not src.topic:
            f.problems.append(f"key {key}.topic: source type mqtt needs a topic")
        elif isinstance(src, CameraSourceConfig) and devices and installed_here and (why := _camera_problem(src.device)):
            f.problems.append(f"key {key}.device: {why}")
        else:
            f.notes.append(f"{key} {src.type}: cannot be opened by a check here; `edge-agent run` reports it")


def _try_open(key: str, src: SourceConfig, bundle: Bundle, f: Findings) -> None:
    """Open the source with the bundle's frame contract, exactly as `run` does, and close it again."""
    from agent.serving.sources import open_source

    m = bundle.manifest
    try:
        open_source(src, m.frame, m.preprocess.resize).close()
    except AgentError as exc:
        text = str(exc)
        f.problems.append(text if text.startswith("key ") else f"key {key}: {text}")


def _check_metrics(cfg: Config, f: Findings) -> None:
    if not cfg.metrics.listen:
        if cfg.metrics.live_view:
            f.problems.append("key metrics.live_view: the live view is served on metrics.listen, which is not set: "
                              "set metrics.listen: 127.0.0.1:9108 (or another HOST:PORT)")
        return
    from agent.link.prometheus import parse_listen

    try:
        parse_listen(cfg.metrics.listen)
    except AgentError as exc:
        f.problems.append(str(exc))
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        f.problems.append("key metrics.listen: set, but prometheus_client is not installed: "
                          + install_hint("metrics", "prometheus-client"))


def _check_mqtt(cfg: Config, installed_here: bool, f: Findings) -> None:
    m = cfg.mqtt
    if not m.enabled:
        return
    from agent.link.mqtt import resolve_password

    try:
        resolve_password(m)
    except AgentError as exc:
        f.problems.append(str(exc))
    if m.tls is not None and installed_here:
        for name in ("ca_file", "cert_file", "key_file"):
            p = getattr(m.tls, name)
            if p is not None and not Path(p).is_file():
                f.problems.append(f"key mqtt.tls.{name}: {p} does not exist")
    f.notes.append(f"mqtt broker {m.host}:{m.port}: not contacted by a check; `edge-agent run` retries until it "
                   "answers")
