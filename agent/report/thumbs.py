"""Small JPEG thumbnails of the golden samples' raw frames (or a sparkline of a sensor window), as
data URIs, so the page stays one self-contained file."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from agent.npio import open_npz

THUMB_PX = 96


def bundle_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest as plain data (no verification: the page only shows what is there)."""
    try:
        data = yaml.safe_load((root / "bundle.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def golden_files(root: Path, manifest: Mapping[str, Any] | None) -> list[Path]:
    listed = (manifest or {}).get("golden")
    if isinstance(listed, list) and listed:
        return [root / str(p) for p in listed]
    return sorted(root.glob("golden/*.npz"))


def _image_thumb(raw: np.ndarray, color: str) -> str | None:
    import cv2

    img = raw
    if img.ndim == 4:  # a sequence [T, H, W, C]: its first frame
        img = img[0]
    if img.ndim == 3 and img.shape[-1] == 1:
        img = img[..., 0]
    if img.dtype != np.uint8:
        lo, hi = float(np.min(img)), float(np.max(img))
        img = ((img - lo) / (hi - lo or 1.0) * 255).clip(0, 255).astype(np.uint8)
    if img.ndim == 3 and img.shape[-1] == 3 and color == "rgb":
        img = img[..., ::-1]  # OpenCV writes BGR
    h, w = img.shape[:2]
    scale = THUMB_PX / max(h, w)
    img = cv2.resize(img, (max(1, round(w * scale)), max(1, round(h * scale))),
                     interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_NEAREST)
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(img), [cv2.IMWRITE_JPEG_QUALITY, 80])
    return "data:image/jpeg;base64," + base64.b64encode(buf.tobytes()).decode() if ok else None


def _sensor_thumb(raw: np.ndarray) -> str:
    """A sensor window (samples x channels) as a tiny inline SVG polyline per channel."""
    x = np.asarray(raw, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    x = x.reshape(x.shape[0], -1)[:, :4]
    x = x[:: max(1, len(x) // THUMB_PX)]  # about one point per pixel: the page stays small
    lo, hi = float(x.min()), float(x.max())
    span = hi - lo or 1.0
    w, h = THUMB_PX, THUMB_PX // 2
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    lines = []
    for ch in range(x.shape[1]):
        pts = " ".join(f"{i * w / max(len(x) - 1, 1):.1f},{h - (v - lo) / span * h:.1f}" for i, v in enumerate(x[:, ch]))
        lines.append(f'<polyline fill="none" stroke="{colors[ch]}" stroke-width="1" points="{pts}"/>')
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">{"".join(lines)}</svg>'
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def golden_thumbnails(root: Path | None, manifest: Mapping[str, Any] | None) -> dict[int, str]:
    """sample index -> data URI; samples that cannot be read are left out (the page says so)."""
    if root is None or not root.is_dir():
        return {}
    frame = (manifest or {}).get("input", {}).get("frame", {}) if manifest else {}
    kind, color = frame.get("kind", "image"), frame.get("color", "rgb")
    out: dict[int, str] = {}
    for i, path in enumerate(golden_files(root, manifest)):
        try:
            with open_npz(path) as z:
                raw = z["raw"]
        except Exception:  # a missing or unreadable sample only loses its thumbnail
            continue
        uri = _sensor_thumb(raw) if kind == "sensor" or raw.ndim < 2 or raw.dtype.kind == "f" and raw.ndim == 2 \
            else _image_thumb(raw, color)
        if uri:
            out[i] = uri
    return out
