"""What a self-test is asked to do (`SelftestOptions`), and how a config becomes those options: the selection
policy, the providers, the batch sizes and callers serving will run, and which reduced decode scales and paths
the configured sources can choose (known before they open: a forced decode_scale, a video file's header).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from agent.proof.reduced_decode import SourceScaleLimit
from agent.proof.selection import SelectionPolicy
from agent.proof.terms import DEFAULT_ORDER, SessionSettings, with_compile_caches
from agent.vocabulary.jpeg import MJPEG_FOURCCS


@dataclass(frozen=True)
class SelftestOptions:
    policy: SelectionPolicy = SelectionPolicy()
    settings: SessionSettings = SessionSettings()
    provider_order: tuple[str, ...] = DEFAULT_ORDER
    provider_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    use_cache: bool = True
    latency_runs: int | None = None  # None: the bundle's own setting
    # the bundle's own count may stop once its answer cannot change (`selection.latency_settled`); False:
    # every run is made (the child's `run:<key>#N` fault must reach its N-th run)
    settle: bool = True
    max_batch: int = 1  # the largest micro-batch serving will run: every size up to it is proven
    workers: int = 1    # inference callers serving runs at once on one session: the golden set runs so too
    # why no configured source can decode at a reduced scale (the check would buy nothing); None: prove them
    skip_reduced_decode: str | None = None
    # what each configured source can choose of the reduced scales, known before it opens; (): unknown, all proven
    source_limits: tuple["SourceScaleLimit", ...] = ()
    sleep: Callable[[float], None] = time.sleep  # the wait between latency re-measurements
    serve_disproven: bool = False  # candidates disproven while serving are proven too (boot.last_resort's proof)


def options_from_config(cfg: Any, provider: str | None = None, variant: str | None = None,
                        use_cache: bool | None = None) -> SelftestOptions:
    sel = cfg.selection
    policy = SelectionPolicy(provider=provider or sel.provider, variant=variant or sel.variant,
                             allow_cpu_fallback=sel.allow_cpu_fallback, prefer_margin=sel.prefer_margin,
                             latency_retries=sel.latency_retries, latency_backoff_s=sel.latency_backoff_s,
                             when_too_slow=sel.when_too_slow)
    order = tuple(cfg.providers.order)
    if policy.provider and policy.provider not in order:
        order = (policy.provider,) + order
    pipe = getattr(cfg, "pipeline", None)
    max_batch = int(getattr(pipe, "max_batch", 1) or 1)
    if pipe is not None and getattr(cfg, "sources", None) and getattr(pipe, "batch_across_sources", False):
        max_batch = max(max_batch, len(cfg.sources))  # one frame per source in a batch (Pipeline)
    return SelftestOptions(policy=policy, settings=cfg.session, provider_order=order,
                           provider_options=with_compile_caches(cfg.providers.options, str(cfg.state_dir / "cache")),
                           use_cache=sel.use_cache if use_cache is None else use_cache, max_batch=max_batch,
                           workers=serving_workers(pipe), skip_reduced_decode=no_reduced_decode(cfg),
                           source_limits=source_scale_limits(cfg))


JPEG_SUFFIXES = (".jpg", ".jpeg")


def no_reduced_decode(cfg: Any) -> str | None:
    """Why none of the config's sources can serve a reduced-scale decode, so proving the scales buys nothing
    (about half of a small model's cold proof); None when one might (a camera, a stream, a video, MQTT
    images, a folder holding JPEGs, or a source not known yet)."""
    sources = list(getattr(cfg, "source_list", ()) or ())
    if not sources:
        return None
    for src in sources:
        if src.picture_scale() in (1, None):  # decoded at full size, or sensor samples
            continue
        if src.type == "folder" and src.path is not None and Path(src.path).is_dir() and not any(
                p.suffix.lower() in JPEG_SUFFIXES for p in Path(src.path).iterdir()):
            continue
        return None
    return ("no configured source decodes at a reduced scale (sensor windows, decode_scale: 1, or folders "
            "without JPEGs): the scales are not proven, frames are decoded at full size")


def source_scale_limits(cfg: Any) -> tuple[SourceScaleLimit, ...]:
    """What each configured source can choose of the reduced scales, before it opens: a forced decode_scale, and a
    video file's frame size from its header. () when there are no sources (every scale is proven)."""
    out = []
    for src in list(getattr(cfg, "source_list", ()) or ()):
        scale = src.picture_scale()  # None: sensor samples, never decoded
        forced = None if scale in ("auto", None) else int(scale)
        frame, fourcc = video_header(Path(src.path)) if src.type == "video" and src.path is not None else (None, None)
        out.append(SourceScaleLimit(forced, frame, _paths_of(src, fourcc)))
    return tuple(out)


def _paths_of(src: Any, fourcc: str | None) -> frozenset[str] | None:
    """The reduced paths a source can serve through, known before it opens; None: unknown (a camera, a stream,
    MQTT images, a folder not there yet). A video file's codec is in its header."""
    if src.picture_scale() in (1, None):
        return frozenset()
    if src.type == "folder" and src.path is not None and Path(src.path).is_dir():
        has_jpeg = any(p.suffix.lower() in JPEG_SUFFIXES for p in Path(src.path).iterdir())
        return frozenset({"jpeg"}) if has_jpeg else frozenset()
    if src.type == "video" and fourcc and fourcc not in MJPEG_FOURCCS:
        return frozenset({"video"})  # H.264, H.265...: the decoder's planes, never JPEG's DCT scaling
    return None  # an MJPEG file may be served either way (its packets to libjpeg, or FFmpeg's frames)


def video_frame_size(path: Path) -> tuple[int, int] | None:
    """(height, width) a video file's header declares; None when it cannot be read (then nothing is assumed)."""
    return video_header(path)[0]


def video_header(path: Path) -> tuple[tuple[int, int] | None, str | None]:
    """(height, width) and the codec's FourCC a video file's header declares; None for what cannot be read
    (then nothing is assumed)."""
    if not path.is_file():
        return None, None
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        h, w = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        code = int(cap.get(cv2.CAP_PROP_FOURCC))
    finally:
        cap.release()
    fourcc = "".join(chr((code >> 8 * i) & 0xFF) for i in range(4)).strip("\0 ") if code > 0 else None
    return ((h, w) if h > 0 and w > 0 else None), (fourcc or None)


def serving_workers(pipe: Any) -> int:
    """The inference callers serving runs at once: the configured pool, else up to the cores (at most 4),
    as `Pipeline` sizes it."""
    fixed = int(getattr(pipe, "inference_workers", 0) or 0)
    return fixed if fixed > 0 else max(1, min(len(os.sched_getaffinity(0)), 4))
