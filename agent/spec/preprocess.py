"""The bundle's preprocessing: raw frame -> model input tensor.

The one implementation used by serving, the self-test and `bundle create`; there is no second copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from agent.errors import PreprocessError
from agent.spec.manifest import FrameSpec, PreprocessSpec, ResizeSpec

_INTERPOLATION = {
    "nearest": cv2.INTER_NEAREST,
    "linear": cv2.INTER_LINEAR,
    "area": cv2.INTER_AREA,
    "cubic": cv2.INTER_CUBIC,
}

_COLOR_CONVERSIONS = {
    ("bgr", "rgb"): cv2.COLOR_BGR2RGB,
    ("rgb", "bgr"): cv2.COLOR_RGB2BGR,
    ("bgr", "gray"): cv2.COLOR_BGR2GRAY,
    ("rgb", "gray"): cv2.COLOR_RGB2GRAY,
    ("gray", "rgb"): cv2.COLOR_GRAY2RGB,
    ("gray", "bgr"): cv2.COLOR_GRAY2BGR,
}


@dataclass(frozen=True)
class Letterbox:
    """How a frame was fitted into the model input, so boxes can be mapped back to the frame."""

    scale_x: float
    scale_y: float
    pad_x: float
    pad_y: float

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        out = boxes.astype(np.float32, copy=True)
        out[..., [0, 2]] = (out[..., [0, 2]] - self.pad_x) / self.scale_x
        out[..., [1, 3]] = (out[..., [1, 3]] - self.pad_y) / self.scale_y
        return out


IDENTITY = Letterbox(1.0, 1.0, 0.0, 0.0)


def imread_flag(frame: FrameSpec) -> int:
    return cv2.IMREAD_GRAYSCALE if frame.color == "gray" else cv2.IMREAD_COLOR


def bgr_to_frame(img: np.ndarray, frame: FrameSpec) -> np.ndarray:
    """OpenCV decodes to BGR; deliver the bundle's frame colour order."""
    if frame.color == "gray":
        return img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    if img.ndim == 2:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB) if frame.color == "rgb" else img


def read_image_file(path: str, frame: FrameSpec) -> np.ndarray | None:
    """An image file as the bundle's raw frame, or None when it does not decode."""
    img = cv2.imread(path, imread_flag(frame))
    return None if img is None else bgr_to_frame(img, frame)


def fit_geometry(height: int, width: int, resize: ResizeSpec | None) -> Letterbox:
    if resize is None:
        return IDENTITY
    if resize.mode == "stretch":
        return Letterbox(resize.width / width, resize.height / height, 0.0, 0.0)
    r = min(resize.width / width, resize.height / height)
    new_w, new_h = round(width * r), round(height * r)
    return Letterbox(r, r, (resize.width - new_w) // 2, (resize.height - new_h) // 2)


class Preprocessor:
    """Compiled from a bundle's spec once; call it on each raw frame.

    Scale, mean and std are folded into one multiply-add (x * a - b) per element.
    """

    def __init__(self, spec: PreprocessSpec, frame: FrameSpec):
        self.spec = spec
        self.frame = frame
        if frame.kind == "image":
            self.channels = 1 if (spec.color or frame.color) == "gray" else 3
        else:
            self.channels = frame.channels
        mean = np.asarray(spec.mean or (0.0,), dtype=np.float32)
        std = np.asarray(spec.std or (1.0,), dtype=np.float32)
        mean = np.broadcast_to(mean, (self.channels,)).copy()
        std = np.broadcast_to(std, (self.channels,)).copy()
        self._mul = (np.float32(spec.scale) / std).astype(np.float32)
        self._sub = (mean / std).astype(np.float32)
        self._identity_affine = bool(np.all(self._mul == 1.0) and np.all(self._sub == 0.0))
        self._dtype = np.dtype(spec.dtype)

    def check(self, raw: np.ndarray) -> None:
        """Raise PreprocessError when a raw frame cannot be what this bundle expects."""
        f = self.frame
        if not isinstance(raw, np.ndarray):
            raise PreprocessError(f"expected a numpy array frame, got {type(raw).__name__}")
        if f.kind == "image":
            channels = 1 if raw.ndim == 2 else (raw.shape[2] if raw.ndim == 3 else -1)
            if raw.ndim not in (2, 3) or channels != f.channels:
                raise PreprocessError(
                    f"image frame shape {raw.shape} does not have {f.channels} channel(s) (expected HxWx{f.channels})"
                )
            if raw.dtype != np.uint8:
                raise PreprocessError(f"image frame dtype {raw.dtype} is not uint8")
            if self.spec.resize is None and raw.shape[:2] != (f.height, f.width):
                raise PreprocessError(
                    f"image frame size {raw.shape[1]}x{raw.shape[0]} is not the {f.width}x{f.height} the model takes "
                    "and the bundle declares no resize"
                )
            if raw.shape[0] == 0 or raw.shape[1] == 0:
                raise PreprocessError(f"empty image frame {raw.shape}")
        else:
            if raw.shape != (f.window, f.channels):
                raise PreprocessError(f"sensor window shape {raw.shape} is not ({f.window}, {f.channels})")

    def geometry(self, raw: np.ndarray) -> Letterbox:
        return fit_geometry(raw.shape[0], raw.shape[1], self.spec.resize) if self.frame.kind == "image" else IDENTITY

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        """Raw frame -> tensor with a leading batch dimension of 1."""
        self.check(raw)
        if self.frame.kind == "image":
            x = self._image(raw)
        else:
            x = raw.astype(np.float32, copy=True)  # (W, C)
        x = self._normalise(x)
        layout = self.spec.layout
        if layout == "nchw" or layout == "ncw":
            x = np.moveaxis(x, -1, 0)
        return np.ascontiguousarray(x[np.newaxis], dtype=self._dtype)

    def _image(self, raw: np.ndarray) -> np.ndarray:
        spec, frame = self.spec, self.frame
        img = raw
        target = spec.color or frame.color
        if frame.color != target:
            img = cv2.cvtColor(img, _COLOR_CONVERSIONS[(frame.color, target)])
        r = spec.resize
        if r is not None and img.shape[:2] != (r.height, r.width):
            interp = _INTERPOLATION[r.interpolation]
            if r.mode == "stretch":
                img = cv2.resize(img, (r.width, r.height), interpolation=interp)
            else:
                g = fit_geometry(img.shape[0], img.shape[1], r)
                new_w, new_h = round(img.shape[1] * g.scale_x), round(img.shape[0] * g.scale_y)
                small = cv2.resize(img, (new_w, new_h), interpolation=interp)
                canvas = np.full((r.height, r.width) + small.shape[2:], r.pad_value, dtype=np.uint8)
                y0, x0 = int(g.pad_y), int(g.pad_x)
                canvas[y0 : y0 + new_h, x0 : x0 + new_w] = small
                img = canvas
        if img.ndim == 2:
            img = img[:, :, np.newaxis]
        return img.astype(np.float32)

    def _normalise(self, x: np.ndarray) -> np.ndarray:
        if self._identity_affine:
            return x
        x *= self._mul
        x -= self._sub
        return x


def preprocess_batch(pre: Preprocessor, frames: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([pre(f) for f in frames], axis=0)
