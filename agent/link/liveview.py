"""The live view: the latest frame of each source with the result it was served drawn on it, beside the proof's
verdict, health, the audit and latency, on the agent's own HTTP server (the one behind /metrics; same listener,
so the same access story: localhost unless `metrics.listen` says otherwise). Off unless `metrics.live_view`.

Cheap when nobody watches: the pipeline asks `wanted` (two float compares) and keeps nothing; nothing is drawn.
Bounded when someone does: a source's pixels are copied at most `KEEP_PER_S` times a second, only while a page
or snapshot was asked for in the last `WATCH_WINDOW_S`, and each kept frame is drawn and JPEG-encoded once,
however many viewers ask for it. Pages refresh themselves (snapshots), so a viewer holds no connection open.
"""

from __future__ import annotations

import html
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping
from urllib.parse import quote, unquote

import numpy as np

WATCH_WINDOW_S = 10.0  # a page or snapshot asked for within this long: frames are kept
KEEP_PER_S = 5.0       # at most this many frames a second per source are copied while watched
MAX_PENDING = 32       # kept pixels waiting for their result (a frame refused on the way never comes back)
REFRESH_S = 1          # the page reloads its snapshots this often
MIN_WIDTH = 320        # frames narrower than this are drawn enlarged (whole multiples, nearest neighbour)
MAX_STREAMS = 4        # MJPEG viewers at once (each holds a server thread); more are answered 503
STREAM_MAX_S = 600.0   # an MJPEG stream ends after this long (a forgotten tab does not keep frames kept forever)
SNAPSHOT_MAX_BYTES = 1 << 20  # an MQTT snapshot's bound: re-encoded at lower quality, then halved, until it fits
BOUNDARY = "edgeagentframe"

GREEN, YELLOW, WHITE, BLACK = (60, 200, 60), (40, 220, 255), (255, 255, 255), (0, 0, 0)  # BGR


@dataclass(frozen=True)
class Kept:
    """One served frame as the view shows it: its pixels (as decoded), the result it was served with."""

    source: str
    pixels: np.ndarray
    scale: int          # decoded at 1/scale of the camera frame: results are in camera pixels
    rgb: bool
    seq: int
    result: Mapping[str, Any]
    served_unix: float


class LiveView:
    """Kept frames per source (written by the pipeline's threads, read by the HTTP threads) and the pages."""

    def __init__(self, health: Callable[[], Mapping[str, Any]], clock: Callable[[], float] = time.monotonic):
        self.health, self.clock = health, clock
        self._lock = threading.Lock()
        self._fresh = threading.Condition(self._lock)  # a kept frame's result came (an MQTT snapshot waits on it)
        self._watched_until = 0.0
        self._next_keep: dict[str, float] = {}
        self._pending: dict[int, tuple[str, np.ndarray, int, bool]] = {}
        self._latest: dict[str, Kept] = {}
        self._jpeg: dict[str, tuple[int, bytes]] = {}  # each source's latest drawn snapshot, by seq
        self.drawn = 0  # frames drawn and encoded (the cost while watched; stays 0 while nobody watches)
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)
        self.sleep = time.sleep

    # -- the pipeline's side -------------------------------------------------------------------------------
    def wanted(self, source: str) -> bool:
        now = self.clock()
        return now < self._watched_until and now >= self._next_keep.get(source, 0.0)

    def keep(self, key: int, source: str, pixels: np.ndarray, scale: int, rgb: bool) -> None:
        """Before the pixels are released: a copy, until the frame's result comes (`served`)."""
        if pixels.ndim not in (2, 3) or pixels.dtype != np.uint8:
            return  # sensor windows, float frames: nothing to look at
        with self._lock:
            self._next_keep[source] = self.clock() + 1.0 / KEEP_PER_S
            if len(self._pending) >= MAX_PENDING:
                self._pending.clear()
            self._pending[key] = (source, pixels.copy(), scale, rgb)

    def served(self, key: int, seq: int, result: Mapping[str, Any]) -> None:
        if not self._pending:  # nobody watches: nothing was kept
            return
        with self._lock:
            got = self._pending.pop(key, None)
            if got is not None:
                source, pixels, scale, rgb = got
                self._latest[source] = Kept(source, pixels, scale, rgb, seq, result, time.time())
                self._fresh.notify_all()

    # -- the HTTP side -------------------------------------------------------------------------------------
    def watched(self) -> None:
        self._watched_until = self.clock() + WATCH_WINDOW_S

    def asked(self) -> float:
        """An MQTT snapshot request: the next frame of every source is kept at once (not after the keep interval);
        returns the wall time after which a kept frame answers it."""
        with self._lock:
            self._watched_until = self.clock() + WATCH_WINDOW_S
            self._next_keep.clear()
        return time.time()

    def served_since(self, source: str, since_unix: float, timeout_s: float) -> Kept | None:
        """The source's first frame served (with its result) at or after `since_unix`, waiting up to `timeout_s`;
        None when none came (the source is stalled, paused, or slower than that)."""
        with self._fresh:
            self._fresh.wait_for(lambda: (k := self._latest.get(source)) is not None and k.served_unix >= since_unix,
                                 timeout=timeout_s)
            kept = self._latest.get(source)
        return kept if kept is not None and kept.served_unix >= since_unix else None

    def sources(self) -> list[str]:
        with self._lock:
            return sorted(self._latest)

    def snapshot(self, source: str) -> bytes | None:
        """The source's latest served frame with its result drawn, as JPEG (drawn once per frame)."""
        self.watched()
        with self._lock:
            kept = self._latest.get(source)
            cached = self._jpeg.get(source)
        if kept is None:
            return None
        if cached is not None and cached[0] == kept.seq:
            return cached[1]
        import cv2

        ok, buf = cv2.imencode(".jpg", draw(kept), [cv2.IMWRITE_JPEG_QUALITY, 80])
        if not ok:
            return None
        data = buf.tobytes()
        with self._lock:
            self._jpeg[source] = (kept.seq, data)
            self.drawn += 1
        return data

    def page(self) -> str:
        self.watched()
        return render_page(self.health(), {s: self._latest.get(s) for s in self.sources()})

    def stream(self, source: str, max_s: float = STREAM_MAX_S) -> Iterable[bytes]:
        """multipart/x-mixed-replace parts: each newly drawn frame of `source`, at most KEEP_PER_S a second, for
        at most `max_s`."""
        end, last = self.clock() + max_s, None
        while self.clock() < end:
            data = self.snapshot(source)  # keeps the view watched while the stream is open
            if data is not None and data is not last:
                last = data
                yield (f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n\r\n"
                       .encode() + data + b"\r\n")
            self.sleep(1.0 / KEEP_PER_S)

    def wsgi(self, fallback: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        """A WSGI app: /live (the page), /live/snapshot/<source>.jpg, /live/stream/<source>.mjpg; anything else to
        `fallback` (/metrics)."""
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO") or "/"
            if path in ("/live", "/live/"):
                body = self.page().encode()
                start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                                          ("Cache-Control", "no-store")])
                return [body]
            if path.startswith("/live/snapshot/") and path.endswith(".jpg"):
                data = self.snapshot(unquote(path[len("/live/snapshot/"):-len(".jpg")]))
                if data is None:
                    start_response("404 Not Found", [("Content-Type", "text/plain")])
                    return [b"no frame served from this source yet (or it is not being watched yet: ask again)\n"]
                start_response("200 OK", [("Content-Type", "image/jpeg"), ("Cache-Control", "no-store")])
                return [data]
            if path.startswith("/live/stream/") and path.endswith(".mjpg"):
                if not self._streams.acquire(blocking=False):
                    start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Retry-After", "10")])
                    return [f"{MAX_STREAMS} live streams are open already: use the snapshots (/live)\n".encode()]
                start_response("200 OK", [("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}"),
                                          ("Cache-Control", "no-store")])
                return _Held(self.stream(unquote(path[len("/live/stream/"):-len(".mjpg")])), self._streams.release)
            return fallback(environ, start_response)

        return app


def bounded_jpeg(img: np.ndarray, max_bytes: int = SNAPSHOT_MAX_BYTES) -> bytes:
    """`img` as JPEG of at most `max_bytes`: quality 80, 60, 40, then each side halved until it fits (a 4K frame
    with fine texture must not become a 3 MB MQTT message)."""
    import cv2

    while True:
        for quality in (80, 60, 40):
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
            if ok and buf.size <= max_bytes:
                return bytes(buf.tobytes())
        if min(img.shape[:2]) <= 16:
            raise ValueError(f"a {img.shape[1]}x{img.shape[0]} JPEG does not fit in {max_bytes} bytes")
        img = cv2.resize(img, (img.shape[1] // 2, img.shape[0] // 2), interpolation=cv2.INTER_AREA)


class _Held:
    """A streamed response that gives its place back when the server closes it (a viewer left, the stream ended,
    or it never started): WSGI calls `close` in every case, where a generator's own `finally` may never run."""

    def __init__(self, parts: Iterable[bytes], release: Callable[[], None]):
        self.parts, self._release = parts, release
        self._released = False

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.parts)

    def close(self) -> None:
        close = getattr(self.parts, "close", None)
        if close is not None:
            close()
        if not self._released:
            self._released = True
            self._release()


def draw(kept: Kept) -> np.ndarray:
    """The frame (BGR, for encoding) with the served result on it: boxes with label and score, keypoints, a mask
    tint, and the result's text (top classes, recognised text, scores, a decision) in the corner."""
    import cv2

    img = kept.pixels
    img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR) if img.ndim == 2 else (
        cv2.cvtColor(img, cv2.COLOR_RGB2BGR) if kept.rgb else img.copy())
    if img.shape[2] == 1:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    up = max(1, MIN_WIDTH // img.shape[1])  # a small frame (a 160 px model input) is enlarged, so words stay legible
    if up > 1:
        img = cv2.resize(img, (img.shape[1] * up, img.shape[0] * up), interpolation=cv2.INTER_NEAREST)
    r = kept.result
    s = up / max(kept.scale, 1)
    _tint_mask(img, r)
    for entry in [*(r.get("boxes") or ()), *(r.get("detections") or ()), *(r.get("regions") or ())]:
        if not isinstance(entry, Mapping) or len(entry.get("box") or ()) != 4:
            continue
        x1, y1, x2, y2 = (int(round(float(v) * s)) for v in entry["box"])
        cv2.rectangle(img, (x1, y1), (x2, y2), GREEN, 2)
        label = " ".join(str(v) for v in (entry.get("label") or entry.get("class_id"), _score(entry.get("score")))
                         if v not in (None, ""))
        _text(img, label, (x1, max(y1 - 4, 12)), GREEN)
        for p in entry.get("keypoints") or ():
            if len(p) >= 2:
                cv2.circle(img, (int(round(float(p[0]) * s)), int(round(float(p[1]) * s))), 3, YELLOW, -1)
    for i, line in enumerate(summary_lines(r)):
        _text(img, line, (6, 20 + 20 * i), WHITE)
    return img


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """What a result says in words, for the corner of the picture and the page."""
    out = [f"{t.get('label') or t.get('class_id')} {_score(t.get('score'))}"
           for t in (result.get("top") or ())[:3] if isinstance(t, Mapping)]
    if result.get("text") is not None:
        out.append(f"text: {result['text']}")
    if isinstance(result.get("scores"), list):
        out.append("scores: " + ", ".join(_score(v) for v in result["scores"][:4]))
    if result.get("decision") is not None:
        out.append(f"decision: {json.dumps(result['decision'])[:60]}")
    n = len(result.get("boxes") or result.get("detections") or result.get("regions") or ())
    if n:
        out.append(f"{n} {'box' if n == 1 else 'boxes'}")
    return out


def _ms(v: Any) -> str:
    return f"{float(v):.1f}" if isinstance(v, (int, float)) else "-"


def _score(v: Any) -> str:
    return f"{float(v):.2f}" if isinstance(v, (int, float)) else ""


def _text(img: np.ndarray, text: str, at: tuple[int, int], color: tuple[int, int, int]) -> None:
    import cv2

    size = 0.55
    cv2.putText(img, text, at, cv2.FONT_HERSHEY_SIMPLEX, size, BLACK, 3, cv2.LINE_AA)
    cv2.putText(img, text, at, cv2.FONT_HERSHEY_SIMPLEX, size, color, 1, cv2.LINE_AA)


def _tint_mask(img: np.ndarray, result: Mapping[str, Any]) -> None:
    """A mask served as column-major RLE (background first): tinted over the picture at its size."""
    rle = result.get("rle")
    if not isinstance(rle, Mapping) or len(rle.get("size") or ()) != 2:
        return
    import cv2

    h, w = (int(v) for v in rle["size"])
    flat = np.zeros(h * w, np.uint8)
    at, on = 0, False
    for n in rle.get("counts") or ():
        if on:
            flat[at:at + int(n)] = 1
        at, on = at + int(n), not on
    mask = cv2.resize(flat.reshape(w, h).T, (img.shape[1], img.shape[0]), interpolation=cv2.INTER_NEAREST)
    img[mask > 0] = (0.5 * img[mask > 0] + 0.5 * np.array(YELLOW)).astype(np.uint8)


def render_page(health: Mapping[str, Any], latest: Mapping[str, Kept | None]) -> str:
    """The page: each source's snapshot (reloaded every REFRESH_S), its result in words, and beside them the proof's
    verdict, what serves, the audit and the latency. No script, nothing fetched from elsewhere."""
    fig = health.get("selftest") or {}
    verdict = str(fig.get("verdict") or ("serving" if health.get("serving") else "not serving"))
    audit = health.get("audit") or {}
    lat = ((health.get("pipeline") or {}).get("latency_ms") or {}).get("total") or {}
    bundle = health.get("bundle") or {}
    facts = [("verdict", verdict.upper()),
             ("serving", f"{bundle.get('bundle')} v{bundle.get('version')} {health.get('variant')}"
              if health.get("serving") else f"nothing: {health.get('not_serving_reason')}"),
             ("degraded", fig.get("degraded") or (audit.get("degraded") or {}).get("check") or "-"),
             ("audit", f"{audit.get('state', '-')}: {audit.get('canary_runs', 0)} canaries, "
                       f"{audit.get('live_windows', 0)} live windows"),
             ("latency p50/p95", f"{_ms(lat.get('p50'))} / {_ms(lat.get('p95'))} ms"),
             ("fps", str((health.get("pipeline") or {}).get("fps_out", "-")))]
    e = html.escape
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in facts)
    cards = []
    for i, name in enumerate(latest):
        # the words are drawn on the picture itself: a caption here would be of the frame this page saw, and the
        # snapshot, fetched a moment later, may be a newer one
        cards.append(f"<figure class='src'><img id='live-{i}' alt='{e(name)}' "
                     f"src='/live/snapshot/{quote(name, safe='')}.jpg'><figcaption><b>{e(name)}</b>: its latest "
                     f"served frame, the result drawn as served (<a href='/live/stream/{quote(name, safe='')}.mjpg'>"
                     "MJPEG stream</a>)</figcaption></figure>")
    if not cards:
        cards.append("<p id='no-frames'>No frame served yet: the page reloads until one is.</p>")
    cls = verdict if verdict in ("pass", "degraded", "fail") else "other"
    return (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{REFRESH_S}'>"
            f"<title>edge-agent live: {e(str(health.get('device_id', '')))}</title><style>{CSS}</style></head><body>"
            f"<h1>{e(str(health.get('device_id', 'edge-agent')))} <span id='verdict' class='badge {cls}'>"
            f"{e(verdict.upper())}</span></h1><div class='row'><div>{''.join(cards)}</div>"
            f"<table id='facts'>{rows}</table></div></body></html>")


CSS = ("body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa}.row{display:flex;gap:24px;"
       "align-items:flex-start}figure.src{margin:0 0 16px}figure.src img{max-width:640px;min-width:320px;"
       "image-rendering:pixelated;border:1px solid #ccc}th{text-align:left;padding-right:12px;color:#555}"
       ".badge{padding:2px 8px;border-radius:9px;color:#fff;font-size:14px}.pass{background:#2e7d32}"
       ".degraded{background:#ef6c00}.fail{background:#c62828}.other{background:#78909c}")
