"""Pre recipes (agent/bundle/graphs/pre_image.py) in real onnxruntime sessions against numpy references
written from each source package's documented preprocessing (YOLOX preproc, Ultralytics LetterBox,
torchvision Resize(int) + CenterCrop, U2Net's per-image max normalisation), at several frame sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
import cv2  # noqa: E402
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.errors import UsageError  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402
from agent.vocabulary.manifest import ResizeSpec  # noqa: E402
from agent.vocabulary.preprocess import fit_geometry  # noqa: E402

SIZES = [(480, 640), (333, 500), (720, 405), (97, 131)]


def session(recipe: str, **params: Any) -> ort.InferenceSession:
    return ort.InferenceSession(build_graph(recipe, params).SerializeToString(), providers=[CPU])


def run(sess: ort.InferenceSession, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, geometry = sess.run(None, {"frame": frame})
    return x, geometry


def frame_of(h: int, w: int, seed: int, hi: int = 256) -> np.ndarray:
    """Random pixels plus smooth structure (a gradient and a disc), so both noise and edges are resized."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = (xx * 200 // max(w, 1) + ((yy - h / 2) ** 2 + (xx - w / 2) ** 2 < (min(h, w) / 3) ** 2) * 40)
    noise = rng.integers(0, 40, (h, w, 3))
    return ((base[..., None] + noise) % hi).astype(np.uint8)


def bilinear_half_pixel(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """The textbook half-pixel bilinear (what cv2 INTER_LINEAR computes, in float), edges clamped."""
    h, w = img.shape[:2]
    src = img.astype(np.float64)

    def axis(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        x = np.clip(x, 0, n_in - 1)
        x0 = np.floor(x).astype(int)
        x1 = np.minimum(x0 + 1, n_in - 1)
        return x0, x1, x - x0

    y0, y1, fy = axis(out_h, h)
    x0, x1, fx = axis(out_w, w)
    top = src[y0][:, x0] * (1 - fx)[None, :, None] + src[y0][:, x1] * fx[None, :, None]
    bot = src[y1][:, x0] * (1 - fx)[None, :, None] + src[y1][:, x1] * fx[None, :, None]
    return top * (1 - fy)[:, None, None] + bot * fy[:, None, None]


def yolox_preproc(img: np.ndarray, input_size: tuple[int, int]) -> tuple[np.ndarray, float]:
    """yolox/data/data_augment.py preproc (0.3.0): int() sizes, top-left, pad 114, BGR, CHW float32."""
    padded = np.ones((input_size[0], input_size[1], 3), dtype=np.uint8) * 114
    r = min(input_size[0] / img.shape[0], input_size[1] / img.shape[1])
    resized = cv2.resize(img, (int(img.shape[1] * r), int(img.shape[0] * r)), interpolation=cv2.INTER_LINEAR)
    padded[: int(img.shape[0] * r), : int(img.shape[1] * r)] = resized
    return np.ascontiguousarray(padded.transpose(2, 0, 1), dtype=np.float32), r


def ultralytics_letterbox(img: np.ndarray, new_shape: tuple[int, int]) -> tuple[np.ndarray, float, int, int]:
    """ultralytics LetterBox (auto=False, scaleup=True, center=True): round() sizes, the pad split round(d -+ 0.1)."""
    shape = img.shape[:2]
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    new_unpad = int(round(shape[1] * r)), int(round(shape[0] * r))
    dw, dh = (new_shape[1] - new_unpad[0]) / 2, (new_shape[0] - new_unpad[1]) / 2
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    return img, r, left, top


@pytest.mark.parametrize("hw", SIZES)
def test_letterbox_floor_top_left_matches_yolox_preproc(hw: tuple[int, int]) -> None:
    sess = session("pre.letterbox", width=416, height=416, rounding="floor", anchor="top_left", pad_value=114,
                   frame_color="bgr", color="bgr")
    frame = frame_of(*hw, seed=hw[0])
    x, geometry = run(sess, frame)
    want, r = yolox_preproc(frame, (416, 416))
    assert x.shape == (1, 3, 416, 416) and x.dtype == np.float32
    # the same pixels are resized and padded: cv2's fixed-point bilinear differs from float by at most one level
    assert np.abs(x[0] - want).max() <= 1.0
    assert np.mean(x[0] != want) < 0.25  # and most pixels equal
    np.testing.assert_allclose(geometry, [r, r, 0, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("hw", SIZES)
def test_letterbox_round_center_matches_ultralytics_and_the_agents_geometry(hw: tuple[int, int]) -> None:
    sess = session("pre.letterbox", width=320, height=256, rounding="round", anchor="center", scale=1 / 255)
    frame = frame_of(*hw, seed=7 + hw[1])
    x, geometry = run(sess, frame)
    want, r, left, top = ultralytics_letterbox(frame, (256, 320))
    assert np.abs(x[0].transpose(1, 2, 0) * 255 - want).max() <= 1.0 + 1e-3
    np.testing.assert_allclose(geometry, [r, r, left, top, 0, 0], rtol=1e-6)
    g = fit_geometry(*hw, ResizeSpec(width=320, height=256, mode="letterbox"))
    np.testing.assert_allclose(geometry, [g.scale_x, g.scale_y, g.pad_x, g.pad_y, g.crop_x, g.crop_y], rtol=1e-6)


def test_letterbox_floor_and_round_differ_exactly_where_int_and_round_differ() -> None:
    target = 160
    floor_s = session("pre.letterbox", width=target, height=target, rounding="floor", anchor="top_left", pad_value=255)
    round_s = session("pre.letterbox", width=target, height=target, rounding="round", anchor="top_left", pad_value=255)
    differ = same = 0
    for w in range(171, 330, 4):
        h = 230
        frame = frame_of(h, w, seed=w, hi=200)  # never 255, so padded columns and rows are the ones all 255
        r = min(target / h, target / w)
        xf, _ = run(floor_s, frame)
        xr, _ = run(round_s, frame)
        for x, size in ((xf, (int(h * r), int(w * r))), (xr, (round(h * r), round(w * r)))):
            rows, cols = int((x[0] != 255).any(axis=(0, 2)).sum()), int((x[0] != 255).any(axis=(0, 1)).sum())
            assert (rows, cols) == size, (w, rows, cols, size)
        if (int(h * r), int(w * r)) != (round(h * r), round(w * r)):
            differ += 1
            assert not np.array_equal(xf, xr)
        else:
            same += 1
            np.testing.assert_array_equal(xf, xr)
    assert differ >= 5 and same >= 5  # the sweep covers both cases


@pytest.mark.parametrize("hw, cols", [((99, 133), 640), ((115, 154), 639), ((81, 108), 640)])
def test_size_arithmetic_is_float64_like_python(hw: tuple[int, int], cols: int) -> None:
    """int(W * min(640 / H, 640 / W)) in Python's float64: 133 wide -> 640 (float32 makes 639.99994 -> 639),
    154 wide -> 639.9999999999999 -> 639 (float32 makes 640.0): a float32 graph would be one column off."""
    sess = session("pre.letterbox", width=640, height=640, rounding="floor", anchor="top_left", pad_value=255)
    x, _ = run(sess, frame_of(*hw, seed=1, hi=200))
    h, w = hw
    r = min(640 / h, 640 / w)
    assert int(w * r) == cols
    assert int((x[0] != 255).any(axis=(0, 1)).sum()) == cols
    assert int((x[0] != 255).any(axis=(0, 2)).sum()) == int(h * r)


@pytest.mark.parametrize("hw", [(160, 160), (240, 320), (101, 77)])
def test_stretch_matches_bilinear_and_the_agents_geometry(hw: tuple[int, int]) -> None:
    frame = frame_of(*hw, seed=3)
    exact = session("pre.stretch", width=128, height=96, round_resize=False)
    x, geometry = run(exact, frame)
    np.testing.assert_allclose(x[0].transpose(1, 2, 0), bilinear_half_pixel(frame, 96, 128), atol=2e-3)
    rounded, _ = run(session("pre.stretch", width=128, height=96), frame)
    cv = cv2.resize(frame, (128, 96), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    assert np.abs(rounded[0].transpose(1, 2, 0) - cv).max() <= 1.0
    g = fit_geometry(*hw, ResizeSpec(width=128, height=96, mode="stretch"))
    np.testing.assert_allclose(geometry, [g.scale_x, g.scale_y, 0, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("hw", [(480, 640), (97, 131), (320, 640), (1, 7), (721, 1279)])
@pytest.mark.parametrize("out_hw", [(240, 320), (96, 128), (800, 608), (5, 3)])
def test_stretch_cv2_exact_equals_cv2_resize_bit_for_bit(hw: tuple[int, int], out_hw: tuple[int, int]) -> None:
    """resize=cv2_exact: OpenCV's fixed-point INTER_LINEAR on uint8, up- and down-scaling, odd sizes, a one-row
    frame and an exact 2x shrink (where cv2 switches to INTER_AREA)."""
    frame = frame_of(*hw, seed=hw[0] + out_hw[1])
    oh, ow = out_hw
    x, geometry = run(session("pre.stretch", width=ow, height=oh, resize="cv2_exact", layout="nhwc"), frame)
    np.testing.assert_array_equal(x[0], cv2.resize(frame, (ow, oh), interpolation=cv2.INTER_LINEAR))
    np.testing.assert_allclose(geometry, [ow / hw[1], oh / hw[0], 0, 0, 0, 0], rtol=1e-6)


def test_cv2_exact_letterbox_and_colour_order_resize_as_cv2() -> None:
    frame = frame_of(333, 500, seed=5)
    x, _ = run(session("pre.letterbox", width=320, height=320, resize="cv2_exact", layout="nhwc", color="bgr",
                       pad_value=0), frame)
    r = min(320 / 333, 320 / 500)
    nw, nh = round(500 * r), round(333 * r)
    top = (320 - nh) // 2
    ref = cv2.resize(frame[..., ::-1], (nw, nh), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_array_equal(x[0, top:top + nh, (320 - nw) // 2:(320 - nw) // 2 + nw], ref)


def test_cv2_exact_with_another_filter_is_refused() -> None:
    with pytest.raises(UsageError, match="pre.stretch: --param resize: cv2_exact is the linear resize"):
        build_graph("pre.stretch", {"resize": "cv2_exact", "interpolation": "cubic"})


@pytest.mark.parametrize("hw", [(300, 400), (256, 256), (500, 333)])
def test_stretch_crop_is_resize_then_torchvision_centre_crop(hw: tuple[int, int]) -> None:
    frame = frame_of(*hw, seed=11)
    sess = session("pre.stretch_crop", resize_width=257, resize_height=250, width=224, height=224,
                   layout="nhwc", frame_color="rgb", color="bgr")
    x, geometry = run(sess, frame)
    big = cv2.resize(frame[..., ::-1], (257, 250), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    top, left = int(round((250 - 224) / 2.0)), int(round((257 - 224) / 2.0))  # torchvision CenterCrop
    assert x.shape == (1, 224, 224, 3)
    assert np.abs(x[0] - big[top:top + 224, left:left + 224]).max() <= 1.0
    np.testing.assert_allclose(geometry, [257 / hw[1], 250 / hw[0], 0, 0, left, top], rtol=1e-6)


@pytest.mark.parametrize("hw", [(300, 400), (480, 360), (257, 255), (224, 500)])
@pytest.mark.parametrize("conv", ["torchvision", "paddleclas"])
def test_short_side_crop_follows_the_packages_size_and_offset_rounding(hw: tuple[int, int], conv: str) -> None:
    frame = frame_of(*hw, seed=hw[0] + hw[1])
    side, crop = 256, 224
    params = {"size_rounding": "floor", "crop_offset": "round"} if conv == "torchvision" \
        else {"size_rounding": "round", "crop_offset": "floor"}
    x, geometry = run(session("pre.short_side_crop", short_side=side, width=crop, height=crop, **params), frame)
    h, w = hw
    short, long_ = min(h, w), max(h, w)
    # torchvision Resize(int): int(size * long / short); PaddleClas ResizeImage: int(round(...))
    new_long = int(side * long_ / short) if conv == "torchvision" else int(round(side * long_ / short))
    new_w, new_h = (side, new_long) if w <= h else (new_long, side)
    small = cv2.resize(frame, (new_w, new_h), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    if conv == "torchvision":
        top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    else:
        top, left = (new_h - crop) // 2, (new_w - crop) // 2
    assert np.abs(x[0].transpose(1, 2, 0) - small[top:top + crop, left:left + crop]).max() <= 1.0
    np.testing.assert_allclose(geometry, [new_w / w, new_h / h, 0, 0, left, top], rtol=1e-6)
    g = fit_geometry(h, w, ResizeSpec(width=crop, height=crop, mode="short_side_crop", short_side=side, **params))
    np.testing.assert_allclose(geometry, [g.scale_x, g.scale_y, g.pad_x, g.pad_y, g.crop_x, g.crop_y], rtol=1e-6)


@pytest.mark.parametrize("hw", [(480, 640), (97, 131), (64, 32)])
def test_native_pads_right_and_bottom_to_a_multiple_at_any_size(hw: tuple[int, int]) -> None:
    frame = frame_of(*hw, seed=5)
    x, geometry = run(session("pre.native", multiple=32, pad_value=0, frame_color="rgb", color="bgr",
                              mean=[104, 117, 123]), frame)
    h, w = hw
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    want = np.zeros((ph, pw, 3), np.float32)
    want[:h, :w] = frame[..., ::-1]
    want -= np.array([104, 117, 123], np.float32)  # Pytorch_Retinaface: img -= (104, 117, 123), BGR
    assert x.shape == (1, 3, ph, pw)
    np.testing.assert_array_equal(x[0].transpose(1, 2, 0), want)
    np.testing.assert_array_equal(geometry, [1, 1, 0, 0, 0, 0])
    same, _ = run(session("pre.native", multiple=1), frame)
    np.testing.assert_array_equal(same[0].transpose(1, 2, 0), frame.astype(np.float32))


@pytest.mark.parametrize("hw", [(320, 320), (200, 300)])
def test_per_image_max_then_mean_std_matches_u2net(hw: tuple[int, int]) -> None:
    frame = frame_of(*hw, seed=9, hi=180)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    x, _ = run(session("pre.stretch", width=320, height=320, normalize="max", mean=mean, std=std), frame)
    img = cv2.resize(frame, (320, 320), interpolation=cv2.INTER_LINEAR).astype(np.float64)
    img = img / np.max(img)  # U2Net ToTensorLab: image / np.max(image), then (x - mean) / std per channel
    want = (img - np.array(mean)) / np.array(std)
    # one level of cv2 rounding at the max, divided by the max and the std
    assert np.abs(x[0].transpose(1, 2, 0) - want).max() <= 1.0 / img.max() / 180 / 0.224 + 1e-3
    assert np.median(np.abs(x[0].transpose(1, 2, 0) - want)) < 1e-5


def test_per_image_min_max_spans_zero_to_one_on_each_frame() -> None:
    sess = session("pre.native", multiple=1, normalize="minmax")
    for seed, (lo, hi) in enumerate([(30, 90), (0, 255), (100, 101)]):
        frame = np.random.default_rng(seed).integers(lo, hi + 1, (40, 50, 3)).astype(np.uint8)
        x, _ = run(sess, frame)
        f = frame.astype(np.float64)
        np.testing.assert_allclose(x[0].transpose(1, 2, 0), (f - f.min()) / (f.max() - f.min()), atol=1e-6)


def test_uint8_model_input_takes_raw_levels() -> None:
    frame = frame_of(90, 120, seed=2)
    x, _ = run(session("pre.stretch", width=60, height=45, dtype="uint8", layout="nhwc"), frame)
    assert x.dtype == np.uint8 and x.shape == (1, 45, 60, 3)
    cv = cv2.resize(frame, (60, 45), interpolation=cv2.INTER_LINEAR)
    assert np.abs(x[0].astype(int) - cv.astype(int)).max() <= 1


def test_the_output_is_named_for_the_model_input() -> None:
    sess = session("pre.stretch", width=8, height=8, input_name="input.1")
    assert [o.name for o in sess.get_outputs()] == ["input.1", "geometry"]
    assert [i.name for i in sess.get_inputs()] == ["frame"]


@pytest.mark.parametrize("params, words", [
    ({"rounding": "ceil"}, "--param rounding: expected one of round, floor"),
    ({"widht": 3}, "unknown --param widht"),
    ({"width": "wide"}, "--param width: expected an integer"),
    ({"mean": [1, 2]}, "--param mean: expected 1 or 3 numbers"),
])
def test_bad_params_name_the_key(params: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        build_graph("pre.letterbox", params)


DIGITS = Path(__file__).resolve().parents[2] / "models" / "demo-frames" / "digits"


def test_stretch_recipe_reproduces_the_demo_bundles_declarative_preprocessing() -> None:
    """The demo's vocabulary (stretch 160 -> 128 linear, /255, mean 0.5, std 0.25, NCHW) as a recipe: every
    demo frame within one pixel level (1/255/0.25) of agent.vocabulary.preprocess, most elements equal."""
    from agent.vocabulary.manifest import FrameSpec, PreprocessSpec
    from agent.vocabulary.preprocess import Preprocessor, read_image_file

    spec = PreprocessSpec(layout="nchw", dtype="float32", color="rgb", scale=1 / 255, mean=(0.5,) * 3, std=(0.25,) * 3,
                          resize=ResizeSpec(width=128, height=128, mode="stretch", interpolation="linear"))
    frame_spec = FrameSpec(kind="image", height=160, width=160, channels=3, color="rgb")
    declarative = Preprocessor(spec, frame_spec)
    sess = session("pre.stretch", width=128, height=128, scale=1 / 255, mean=[0.5] * 3, std=[0.25] * 3,
                   input_name="input")
    files = sorted(DIGITS.glob("*.png"))[:12]
    assert len(files) == 12
    for path in files:
        raw = read_image_file(str(path), frame_spec)
        assert raw is not None
        x, geometry = run(sess, raw)
        want, g = declarative.with_geometry(raw)
        assert np.abs(x - want).max() <= 1 / 255 / 0.25 + 1e-5
        assert np.mean(np.abs(x - want) < 1e-5) > 0.8
        np.testing.assert_allclose(geometry, [g.scale_x, g.scale_y, g.pad_x, g.pad_y, g.crop_x, g.crop_y], rtol=1e-6)


@pytest.mark.parametrize("hw", [(100, 200), (150, 90)])
def test_per_image_statistics_cover_the_image_never_the_padding(hw: tuple[int, int]) -> None:
    frame = np.random.default_rng(hw[0]).integers(50, 151, (*hw, 3)).astype(np.uint8)
    x, geometry = run(session("pre.letterbox", width=128, height=128, normalize="minmax", pad_value=0,
                              interpolation="nearest"), frame)
    img = x[0].transpose(1, 2, 0)
    s, pad_x, pad_y = float(geometry[0]), int(geometry[2]), int(geometry[3])
    inner = img[pad_y:pad_y + round(hw[0] * s), pad_x:pad_x + round(hw[1] * s)]
    lo, hi = float(frame.min()), float(frame.max())  # nearest keeps the frame's own levels
    assert inner.min() == pytest.approx(0.0, abs=1e-6) and inner.max() == pytest.approx(1.0, abs=1e-6)
    assert img.min() == pytest.approx((0 - lo) / (hi - lo), abs=1e-6)  # the pad, normalised like the image


@pytest.mark.parametrize("hw", [(480, 640), (200, 98)])
def test_an_exact_halving_equals_cv2_bit_for_bit(hw: tuple[int, int]) -> None:
    """At 2x cv2's fixed-point bilinear is exact and rounds halves up; so does the recipe (Round's half-to-even
    would be one level off on about 1 value in 8)."""
    frame = frame_of(*hw, seed=4)
    x, _ = run(session("pre.stretch", width=hw[1] // 2, height=hw[0] // 2, layout="nhwc"), frame)
    np.testing.assert_array_equal(x[0], cv2.resize(frame, (hw[1] // 2, hw[0] // 2), interpolation=cv2.INTER_LINEAR))


def det_resize_for_test(img: np.ndarray, limit_side_len: int, limit_type: str) -> tuple[np.ndarray, float, float]:
    """PaddleOCR ppocr/data/imaug/operators.py DetResizeForTest.resize_image_type0 -> (img, ratio_h, ratio_w)."""
    h, w = img.shape[:2]
    if limit_type == "max":
        ratio = (float(limit_side_len) / h if h > w else float(limit_side_len) / w) if max(h, w) > limit_side_len else 1.0
    else:
        ratio = (float(limit_side_len) / h if h < w else float(limit_side_len) / w) if min(h, w) < limit_side_len else 1.0
    resize_h, resize_w = int(h * ratio), int(w * ratio)
    resize_h = max(int(round(resize_h / 32) * 32), 32)
    resize_w = max(int(round(resize_w / 32) * 32), 32)
    img = cv2.resize(img, (int(resize_w), int(resize_h)))
    return img, resize_h / float(h), resize_w / float(w)


@pytest.mark.parametrize("hw", [(480, 640), (1200, 900), (75, 333), (960, 960), (600, 1301)])
@pytest.mark.parametrize("limit", [("max", 960), ("min", 320)])
def test_fit_multiple_sizes_like_paddleocr_det_resize_for_test(hw: tuple[int, int], limit: tuple[str, int]) -> None:
    limit_type, side = limit
    frame = frame_of(*hw, seed=hw[1])
    x, geometry = run(session("pre.fit_multiple", limit_side=side, limit_type=limit_type, multiple=32,
                              mean=[0.485 * 255, 0.456 * 255, 0.406 * 255], std=[0.229 * 255, 0.224 * 255, 0.225 * 255]),
                      frame)
    img, ratio_h, ratio_w = det_resize_for_test(frame, side, limit_type)
    assert x.shape == (1, 3, *img.shape[:2])
    want = (img.astype(np.float64) - np.array([0.485, 0.456, 0.406]) * 255) / (np.array([0.229, 0.224, 0.225]) * 255)
    assert np.abs(x[0].transpose(1, 2, 0) - want).max() <= 1.0 / (0.224 * 255) + 1e-4
    np.testing.assert_allclose(geometry, [ratio_w, ratio_h, 0, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("hw, out", [((480, 640), (240, 320)), ((300, 400), (416, 600)), ((97, 131), (64, 64))])
@pytest.mark.parametrize("interpolation", ["nearest", "cubic"])
def test_nearest_and_cubic_follow_cv2_shrinking_and_growing(hw: tuple[int, int], out: tuple[int, int],
                                                             interpolation: str) -> None:
    """cv2 INTER_NEAREST (floor(x * in / out)) exactly; INTER_CUBIC (a = -0.75) within one level. A cubic shrink
    once failed in onnxruntime (its cubic Resize refuses NHWC shrinking)."""
    frame = np.random.default_rng(hw[0]).integers(0, 256, (*hw, 3)).astype(np.uint8)
    x, _ = run(session("pre.stretch", width=out[1], height=out[0], interpolation=interpolation, layout="nhwc"), frame)
    flag = cv2.INTER_NEAREST if interpolation == "nearest" else cv2.INTER_CUBIC
    diff = np.abs(x[0] - cv2.resize(frame, out[::-1], interpolation=flag).astype(np.float32))
    assert diff.max() <= (0 if interpolation == "nearest" else 1)
    assert np.mean(diff > 0) < 0.001


def test_float16_model_input() -> None:
    frame = frame_of(60, 80, seed=8)
    x, _ = run(session("pre.stretch", width=40, height=30, dtype="float16", scale=1 / 255), frame)
    want = cv2.resize(frame, (40, 30), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1) / 255
    assert x.dtype == np.float16 and x.shape == (1, 3, 30, 40)
    assert np.abs(x[0].astype(np.float64) - want).max() <= 1 / 255 + 1e-3


@pytest.mark.parametrize("hw", [(480, 640), (333, 250)])
@pytest.mark.parametrize("mode", ["letterbox", "short_side_crop"])
def test_recipes_reproduce_the_vocabularys_letterbox_and_short_side_crop(hw: tuple[int, int], mode: str) -> None:
    """The declarative path (agent.vocabulary.preprocess.Preprocessor) and the equivalent recipe: one pixel level apart
    at most, the same geometry."""
    from agent.vocabulary.manifest import FrameSpec, PreprocessSpec
    from agent.vocabulary.preprocess import Preprocessor

    if mode == "letterbox":
        resize = ResizeSpec(width=320, height=320, mode="letterbox", pad_value=114)
        sess = session("pre.letterbox", width=320, height=320, pad_value=114, scale=1 / 255, color="bgr")
    else:
        resize = ResizeSpec(width=224, height=224, mode="short_side_crop", short_side=256)
        sess = session("pre.short_side_crop", width=224, height=224, short_side=256, scale=1 / 255, color="bgr")
    spec = PreprocessSpec(layout="nchw", dtype="float32", color="bgr", scale=1 / 255, resize=resize)
    declarative = Preprocessor(spec, FrameSpec(kind="image", height=hw[0], width=hw[1], channels=3, color="rgb"))
    frame = frame_of(*hw, seed=21)
    x, geometry = run(sess, frame)
    want, g = declarative.with_geometry(frame)
    assert x.shape == want.shape
    assert np.abs(x - want).max() <= 1 / 255 + 1e-6
    np.testing.assert_allclose(geometry, [g.scale_x, g.scale_y, g.pad_x, g.pad_y, g.crop_x, g.crop_y], rtol=1e-6)
