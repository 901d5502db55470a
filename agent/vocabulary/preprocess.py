"""The bundle's preprocessing: raw frame -> model input tensor.

The one implementation used by serving, the self-test and `bundle create`; there is no second copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from agent.errors import PreprocessError, install_hint
from agent.vocabulary.manifest import FrameSpec, PreprocessSpec, ResizeSpec

_INTERPOLATION = {
    "nearest": cv2.INTER_NEAREST,
    "linear": cv2.INTER_LINEAR,
    "area": cv2.INTER_AREA,
    "cubic": cv2.INTER_CUBIC,
    "lanczos": cv2.INTER_LANCZOS4,
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
class Geometry:
    """How a frame became the model input, so boxes in input pixels map back to frame pixels.

    A frame point x lands at x * scale_x - crop_x + pad_x in the model input (resize, then crop, then pad).
    frame_w/frame_h (0 = unknown) clip mapped boxes to the frame.
    """

    scale_x: float
    scale_y: float
    pad_x: float
    pad_y: float
    crop_x: float = 0.0
    crop_y: float = 0.0
    frame_w: int = 0
    frame_h: int = 0
    input_w: int = 0
    input_h: int = 0

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        out = boxes.astype(np.float32, copy=True)
        out[..., [0, 2]] = (out[..., [0, 2]] - self.pad_x + self.crop_x) / self.scale_x
        out[..., [1, 3]] = (out[..., [1, 3]] - self.pad_y + self.crop_y) / self.scale_y
        if self.frame_w > 0 and self.frame_h > 0:
            out[..., [0, 2]] = np.clip(out[..., [0, 2]], 0, self.frame_w)
            out[..., [1, 3]] = np.clip(out[..., [1, 3]], 0, self.frame_h)
        return out

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


Letterbox = Geometry  # the name before crops and dynamic sizes existed
# fit_multiple input area bound, in limit_side squares: limit_type min grows a 3x700 frame to 960x224000
# (2.5 GB as float32) otherwise; 8 allows aspect ratios up to 8:1.
MAX_FIT_AREA_FACTOR = 8
IDENTITY = Geometry(1.0, 1.0, 0.0, 0.0)


def imread_flag(frame: FrameSpec) -> int:
    return cv2.IMREAD_GRAYSCALE if frame.color == "gray" else cv2.IMREAD_COLOR


def bgr_to_frame(img: np.ndarray, frame: FrameSpec) -> np.ndarray:
    """OpenCV decodes to BGR; deliver the bundle's frame colour order."""
    if frame.color == "gray":
        return img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    if img.ndim == 2:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB) if frame.color == "rgb" else img


# Every image file the agent reads (sample sets for `bundle create`, folder sources): one list, so a folder that
# serves also builds, and the other way round. OpenCV reads all of them.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def read_image_file(path: str, frame: FrameSpec) -> np.ndarray | None:
    """An image file as the bundle's raw frame, or None when it does not decode."""
    img = cv2.imread(path, imread_flag(frame))
    return None if img is None else bgr_to_frame(img, frame)


def letterbox_size(height: int, width: int, r: ResizeSpec) -> tuple[int, int]:
    """(new_w, new_h) of a letterbox's resized image: rounded (OpenCV, Ultralytics) or floored (`rounding: floor`,
    packages that int() the product, e.g. YOLOX); the other side of the padding in either case."""
    s = min(r.width / width, r.height / height)
    if r.rounding == "floor":
        return max(int(width * s), 1), max(int(height * s), 1)
    return round(width * s), round(height * s)


def fit_geometry(height: int, width: int, resize: ResizeSpec | None) -> Geometry:
    """The geometry of fitting a height x width frame with `resize` (pure arithmetic, no pixels)."""
    if resize is None:
        return Geometry(1.0, 1.0, 0.0, 0.0, frame_w=width, frame_h=height, input_w=width, input_h=height)
    r = resize
    if r.mode == "stretch":
        return Geometry(r.width / width, r.height / height, 0.0, 0.0, frame_w=width, frame_h=height,
                        input_w=r.width, input_h=r.height)
    if r.mode == "letterbox":
        s = min(r.width / width, r.height / height)
        new_w, new_h = letterbox_size(height, width, r)
        if r.anchor == "top_left":
            pad_x, pad_y = 0, 0
        else:
            # Ultralytics' split of an odd padding (round(d - 0.1) left/top) equals the floor of half.
            pad_x, pad_y = (r.width - new_w) // 2, (r.height - new_h) // 2
        return Geometry(s, s, pad_x, pad_y, frame_w=width, frame_h=height, input_w=r.width, input_h=r.height)
    if r.mode == "short_side_crop":
        assert r.short_side is not None
        # torchvision Resize(int): the short side becomes short_side, the long side int(short_side * long / short);
        # size_rounding round: PaddleClas ResizeImage's int(round(long * short_side / short))
        to_int = (lambda v: int(round(v))) if r.size_rounding == "round" else int
        if width <= height:
            new_w, new_h = r.short_side, to_int(r.short_side * height / width)
        else:
            new_w, new_h = to_int(r.short_side * width / height), r.short_side
        # torchvision CenterCrop: offset int(round((size - crop) / 2)); crop_offset floor: PaddleClas' (size - crop) // 2
        if r.crop_offset == "floor":
            crop_x, crop_y = (new_w - r.width) // 2, (new_h - r.height) // 2
        else:
            crop_x, crop_y = int(round((new_w - r.width) / 2.0)), int(round((new_h - r.height) / 2.0))
        return Geometry(new_w / width, new_h / height, 0.0, 0.0, crop_x, crop_y, frame_w=width, frame_h=height,
                        input_w=r.width, input_h=r.height)
    # fit_multiple (PaddleOCR DetResizeForTest, limit_type max/min)
    assert r.limit_side is not None
    if r.limit_type == "max":
        ratio = r.limit_side / max(height, width) if max(height, width) > r.limit_side else 1.0
    else:
        ratio = r.limit_side / min(height, width) if min(height, width) < r.limit_side else 1.0
    new_h = max(int(round(height * ratio / r.multiple) * r.multiple), r.multiple)
    new_w = max(int(round(width * ratio / r.multiple) * r.multiple), r.multiple)
    return Geometry(new_w / width, new_h / height, 0.0, 0.0, frame_w=width, frame_h=height, input_w=new_w, input_h=new_h)


class Preprocessor:
    """Compiled from a bundle's spec once; call it on each raw frame.

    Scale, mean and std are folded into one multiply-add (x * a - b) per element.
    """

    def __init__(self, spec: PreprocessSpec, frame: FrameSpec):
        if spec.graph is not None:  # a second, different preprocessing must never run in its place
            raise PreprocessError(f"preprocess.graph {spec.graph!r} runs in its own session (agent.proof.stages), "
                                  "not the declarative preprocessing")
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
        # uint8 models take raw pixels: no float round trip when there is nothing to normalise
        self._raw_pixels = self._dtype == np.uint8 and self._identity_affine and frame.kind == "image"
        self.fixed_size = spec.resize is None or spec.resize.fixed_size
        if spec.resize is not None and spec.resize.resampler == "pil":
            _pillow()  # refused once, when the bundle is compiled, not on every frame

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
            if (why := f.size_problem(raw.shape[0], raw.shape[1])) is not None:
                raise PreprocessError(why)
            r = self.spec.resize
            if r is not None and r.mode == "fit_multiple" and r.limit_side is not None:
                g = fit_geometry(raw.shape[0], raw.shape[1], r)
                if g.input_w * g.input_h > MAX_FIT_AREA_FACTOR * max(r.limit_side, r.multiple) ** 2:
                    raise PreprocessError(f"image frame {raw.shape[1]}x{raw.shape[0]} would become a {g.input_w}x"
                                          f"{g.input_h} input (fit_multiple, limit_side {r.limit_side}): aspect too extreme")
        else:
            if raw.shape != (f.window, f.channels):
                raise PreprocessError(f"sensor window shape {raw.shape} is not ({f.window}, {f.channels})")

    def source_steps(self) -> tuple[tuple[float, ...], tuple[float, ...], int] | None:
        """What one step of the 8-bit image is in tensor units per channel (x = level * step - offset): (steps,
        offsets, channel axis counted from the end); None for sensor windows, whose values are not rounded here."""
        if self.frame.kind != "image" or self.spec.layout not in ("nchw", "nhwc"):
            return None
        axis = -3 if self.spec.layout == "nchw" else -1
        return tuple(float(v) for v in self._mul), tuple(float(v) for v in self._sub), axis

    def geometry(self, raw: np.ndarray) -> Geometry:
        return fit_geometry(raw.shape[0], raw.shape[1], self.spec.resize) if self.frame.kind == "image" else IDENTITY

    def with_geometry(self, raw: np.ndarray) -> tuple[np.ndarray, Geometry]:
        """The tensor and the geometry that maps its boxes back to this frame."""
        return self(raw), self.geometry(raw)

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        """Raw frame -> tensor with a leading batch dimension of 1."""
        self.check(raw)
        if self.spec.jpeg_roundtrip is not None and self.frame.kind == "image":  # the package's JPEG step first
            raw = self.spec.jpeg_roundtrip(raw, self.frame.color)
        if self.frame.kind == "image":
            x = self._image(raw)
        else:
            x = raw.astype(np.float32, copy=True)  # (W, C)
        x = self._normalise(x)
        layout = self.spec.layout
        if layout == "nchw" or layout == "ncw":
            x = np.moveaxis(x, -1, 0)
        elif layout == "nw":  # a one-channel window as the model's [B, W] (e.g. Silero VAD's `input`)
            x = x[:, 0]
        return np.ascontiguousarray(x[np.newaxis], dtype=self._dtype)

    def _image(self, raw: np.ndarray) -> np.ndarray:
        spec, frame = self.spec, self.frame
        img = raw
        target = spec.color or frame.color
        if frame.color != target:
            img = cv2.cvtColor(img, _COLOR_CONVERSIONS[(frame.color, target)])
        if spec.resize is not None:
            img = resize_image(img, spec.resize)
        if img.ndim == 2:
            img = img[:, :, np.newaxis]
        return img if self._raw_pixels else img.astype(np.float32)

    def _normalise(self, x: np.ndarray) -> np.ndarray:
        if self._identity_affine:
            return x
        x *= self._mul
        x -= self._sub
        return x


_PIL_FILTERS = {"nearest": 0, "lanczos": 1, "linear": 2, "cubic": 3, "area": 4}  # PIL.Image.Resampling values
PIL_MISSING = "key preprocess.resize.resampler: pil needs Pillow, which is not installed: " + install_hint("pil", "pillow")


def _pillow() -> Any:
    """Pillow itself: `resampler: pil` promises Pillow's arithmetic, and only Pillow keeps that promise across
    its releases (a numpy port had to stay bit-exact with each one; it was removed)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise PreprocessError(PIL_MISSING) from exc
    return Image


def resize_like_pil(img: np.ndarray, width: int, height: int, interpolation: str) -> np.ndarray:
    """Pillow's Image.resize on a uint8 image (what torchvision transforms do on PIL images): the filter
    widens when shrinking (antialiasing) and each pass rounds to uint8. Raises PreprocessError without Pillow."""
    image = _pillow()
    if not (img.ndim == 2 or (img.ndim == 3 and img.shape[2] in (1, 3, 4))):
        raise PreprocessError(f"key preprocess.resize.resampler: pil resizes 1, 3 or 4 channel images, "
                              f"not shape {img.shape}")
    squeeze = img.ndim == 3 and img.shape[2] == 1
    out = np.asarray(image.fromarray(img[..., 0] if squeeze else img).resize((width, height), _PIL_FILTERS[interpolation]))
    return out[..., None] if squeeze else out


def _resize(img: np.ndarray, width: int, height: int, r: ResizeSpec) -> np.ndarray:
    if r.resampler == "pil":
        return resize_like_pil(img, width, height, r.interpolation)
    return cv2.resize(img, (width, height), interpolation=_INTERPOLATION[r.interpolation])


def resize_image(img: np.ndarray, r: ResizeSpec) -> np.ndarray:
    """One resize step on an (H, W[, C]) uint8 image, per the spec's mode. Pure."""
    h, w = img.shape[:2]
    g = fit_geometry(h, w, r)
    if r.mode in ("stretch", "fit_multiple"):
        if (h, w) == (g.input_h, g.input_w):
            return img
        return _resize(img, g.input_w, g.input_h, r)
    new_w, new_h = letterbox_size(h, w, r) if r.mode == "letterbox" else (round(w * g.scale_x), round(h * g.scale_y))
    small = img if (new_h, new_w) == (h, w) else _resize(img, new_w, new_h, r)
    if r.mode == "short_side_crop":
        x0, y0 = int(g.crop_x), int(g.crop_y)
        return np.ascontiguousarray(small[y0 : y0 + r.height, x0 : x0 + r.width])
    if (new_h, new_w) == (r.height, r.width):
        return small
    canvas = np.full((r.height, r.width) + small.shape[2:], r.pad_value, dtype=img.dtype)
    y0, x0 = int(g.pad_y), int(g.pad_x)
    canvas[y0 : y0 + new_h, x0 : x0 + new_w] = small
    return canvas


def preprocess_batch(pre: Preprocessor, frames: list[np.ndarray]) -> np.ndarray:
    """Frames -> one batch. Frames of different input sizes (fit_multiple) cannot share a batch."""
    tensors = [pre(f) for f in frames]
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise PreprocessError(f"frames make tensors of different shapes {sorted(shapes)}: run them one at a time")
    return np.concatenate(tensors, axis=0)
