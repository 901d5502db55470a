"""`preprocess.jpeg_roundtrip`: the frame encoded as JPEG and decoded again before the pre stage.

Some packages re-encode every frame as JPEG before inference (an NSFW classifier that saves each frame to a
JPEG buffer and reads it back): their model sees JPEG loss, up to tens of 8-bit levels, that a bundle's
preprocessing cannot state any other way. The step is declared, never code in a bundle:

    preprocess:
      jpeg_roundtrip: {quality: 95}

and implemented once here with OpenCV (libjpeg's default 4:2:0 chroma subsampling, baseline, the standard
tables scaled by `quality`, as `cv2.imencode('.jpg', bgr, [IMWRITE_JPEG_QUALITY, q])`), applied to every raw
image frame before the declarative preprocessing or the pre graph, in serving, the self-test and `bundle
create` alike. It reproduces a package that encodes with OpenCV bit for bit; one that encodes with Pillow
(also libjpeg, 4:2:0 by default at quality < 100) uses the same library and tables, so the decoded pixels agree
to a level or so, which the build measures against the package's tensors. `bundle create`'s drift hint names
this key when a round trip at some quality explains the difference (agent/bundle/jpeg_hint.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.errors import BundleError, PreprocessError

if TYPE_CHECKING:  # at run time only where a frame is round-tripped: the manifest parser and `config check`
    import numpy as np  # (which reads the manifest before anything heavy) never import numpy for this key

KEY = "preprocess.jpeg_roundtrip"


@dataclass(frozen=True)
class JpegRoundtrip:
    quality: int = 95

    def __call__(self, raw: np.ndarray, color: str) -> np.ndarray:
        return roundtrip(raw, self.quality, color)


def from_spec(value: Any, where: str = "") -> JpegRoundtrip | None:
    """The manifest's `preprocess.jpeg_roundtrip` mapping as a step (None: not declared)."""
    if value is None or isinstance(value, JpegRoundtrip):
        return value
    if not isinstance(value, Mapping) or set(value) - {"quality"}:
        raise BundleError(f"{where}: key {KEY}: a mapping {{quality: 1..100}}, got {value!r}")
    q = value.get("quality", 95)
    if not isinstance(q, int) or isinstance(q, bool) or not 1 <= q <= 100:
        raise BundleError(f"{where}: key {KEY}.quality: an integer 1..100, got {q!r}")
    return JpegRoundtrip(q)


def roundtrip(raw: np.ndarray, quality: int, color: str) -> np.ndarray:
    """A uint8 image frame (HxWx3 in `color` rgb/bgr, or HxW / HxWx1 grey) after a JPEG encode and decode."""
    import cv2  # here, not at import: the manifest parser reads the declaration without OpenCV
    import numpy as np

    gray = raw.ndim == 2 or raw.shape[2] == 1
    img = raw if gray or color == "bgr" else cv2.cvtColor(raw, cv2.COLOR_RGB2BGR)  # libjpeg's YCbCr from BGR order
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise PreprocessError(f"{KEY}: JPEG encoding a frame of shape {list(raw.shape)} failed")
    out = cv2.imdecode(buf, cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR_BGR)
    if out is None:
        raise PreprocessError(f"{KEY}: decoding the JPEG of a frame of shape {list(raw.shape)} failed")
    if gray:
        return np.asarray(out).reshape(raw.shape)
    return np.asarray(out if color == "bgr" else cv2.cvtColor(out, cv2.COLOR_BGR2RGB))
