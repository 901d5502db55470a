"""post.yolox (agent/bundle/graphs/post_yolox.py) in a real session against YOLOX's own demo decode, written
in numpy from yolox/utils/demo_utils.py (0.3.0): demo_postprocess, multiclass_nms (class-agnostic and
class-aware) and its nms with the legacy +1 areas; boxes divided by the letterbox ratio (and less the pad)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402


def demo_postprocess(outputs: np.ndarray, img_size: tuple[int, int], strides: tuple[int, ...] = (8, 16, 32)) -> np.ndarray:
    grids, expanded = [], []
    hsizes = [img_size[0] // s for s in strides]
    wsizes = [img_size[1] // s for s in strides]
    for hsize, wsize, stride in zip(hsizes, wsizes, strides):
        xv, yv = np.meshgrid(np.arange(wsize), np.arange(hsize))
        grid = np.stack((xv, yv), 2).reshape(1, -1, 2)
        grids.append(grid)
        expanded.append(np.full((*grid.shape[:2], 1), stride))
    grids_a, strides_a = np.concatenate(grids, 1), np.concatenate(expanded, 1)
    outputs = outputs.copy()
    outputs[..., :2] = (outputs[..., :2] + grids_a) * strides_a
    outputs[..., 2:4] = np.exp(outputs[..., 2:4]) * strides_a
    return outputs


def nms(boxes: np.ndarray, scores: np.ndarray, nms_thr: float) -> list[int]:
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.argsort()[::-1]
    keep = []
    while order.size > 0:
        i = order[0]
        keep.append(int(i))
        xx1, yy1 = np.maximum(x1[i], x1[order[1:]]), np.maximum(y1[i], y1[order[1:]])
        xx2, yy2 = np.minimum(x2[i], x2[order[1:]]), np.minimum(y2[i], y2[order[1:]])
        w, h = np.maximum(0.0, xx2 - xx1 + 1), np.maximum(0.0, yy2 - yy1 + 1)
        inter = w * h
        ovr = inter / (areas[i] + areas[order[1:]] - inter)
        order = order[np.where(ovr <= nms_thr)[0] + 1]
    return keep


def multiclass_nms(boxes: np.ndarray, scores: np.ndarray, nms_thr: float, score_thr: float,
                   class_agnostic: bool) -> np.ndarray | None:
    """-> dets [K, 6] (x1, y1, x2, y2, score, class)."""
    if class_agnostic:
        cls_inds = scores.argmax(1)
        cls_scores = scores[np.arange(len(cls_inds)), cls_inds]
        valid = cls_scores > score_thr
        if valid.sum() == 0:
            return None
        vb, vs, vc = boxes[valid], cls_scores[valid], cls_inds[valid]
        keep = nms(vb, vs, nms_thr)
        return np.concatenate([vb[keep], vs[keep, None], vc[keep, None]], 1)
    final = []
    for c in range(scores.shape[1]):
        cs = scores[:, c]
        valid = cs > score_thr
        if valid.sum() == 0:
            continue
        vb, vs = boxes[valid], cs[valid]
        keep = nms(vb, vs, nms_thr)
        final.append(np.concatenate([vb[keep], vs[keep, None], np.full((len(keep), 1), c)], 1))
    return np.concatenate(final, 0) if final else None


def yolox_reference(head: np.ndarray, img_size: tuple[int, int], ratio: float, pad: tuple[float, float],
                    frame_hw: tuple[int, int], class_agnostic: bool, nms_thr: float = 0.45,
                    score_thr: float = 0.1) -> np.ndarray:
    """YOLOX onnx_inference.py: decode, cxcywh -> xyxy, /= ratio, multiclass_nms; then the clip to the frame."""
    pred = demo_postprocess(head, img_size)[0]
    boxes, scores = pred[:, :4], pred[:, 4:5] * pred[:, 5:]
    xyxy = np.ones_like(boxes)
    xyxy[:, 0] = boxes[:, 0] - boxes[:, 2] / 2.0
    xyxy[:, 1] = boxes[:, 1] - boxes[:, 3] / 2.0
    xyxy[:, 2] = boxes[:, 0] + boxes[:, 2] / 2.0
    xyxy[:, 3] = boxes[:, 1] + boxes[:, 3] / 2.0
    xyxy[:, [0, 2]] -= pad[0]
    xyxy[:, [1, 3]] -= pad[1]
    xyxy /= ratio
    dets = multiclass_nms(xyxy, scores, nms_thr, score_thr, class_agnostic)
    if dets is None:
        return np.zeros((0, 6), np.float32)
    dets[:, [0, 2]] = np.clip(dets[:, [0, 2]], 0, frame_hw[1])
    dets[:, [1, 3]] = np.clip(dets[:, [1, 3]], 0, frame_hw[0])
    return dets


def n_cells(h: int, w: int) -> int:
    return sum((h // s) * (w // s) for s in (8, 16, 32))


def random_head(h: int, w: int, classes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = n_cells(h, w)
    head = np.empty((1, n, 5 + classes), np.float32)
    head[..., :2] = rng.uniform(-0.5, 1.5, (1, n, 2))
    head[..., 2:4] = rng.uniform(-0.5, 2.5, (1, n, 2))
    head[..., 4] = rng.uniform(0, 1, (1, n)) ** 3
    head[..., 5:] = rng.uniform(0, 1, (1, n, classes))
    return head


def structured_head(h: int, w: int, classes: int, seed: int) -> np.ndarray:
    """A few objects, each seen by its centre cell and neighbours at every stride (what NMS must merge)."""
    rng = np.random.default_rng(seed)
    head = np.zeros((1, n_cells(h, w), 5 + classes), np.float32)
    head[..., 2:4] = -3.0
    head[..., 5:] = 0.01
    for _ in range(6):
        cx, cy, bw, bh = rng.uniform(0.2, 0.8) * w, rng.uniform(0.2, 0.8) * h, rng.uniform(20, 120), rng.uniform(20, 120)
        c = int(rng.integers(classes))
        base = 0
        for s in (8, 16, 32):
            gh, gw = h // s, w // s
            gx, gy = int(cx // s), int(cy // s)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    x, y = gx + dx, gy + dy
                    if 0 <= x < gw and 0 <= y < gh:
                        i = base + y * gw + x
                        head[0, i, 0] = cx / s - x + rng.normal(0, 0.05)
                        head[0, i, 1] = cy / s - y + rng.normal(0, 0.05)
                        head[0, i, 2] = np.log(bw / s) + rng.normal(0, 0.05)
                        head[0, i, 3] = np.log(bh / s) + rng.normal(0, 0.05)
                        head[0, i, 4] = rng.uniform(0.5, 0.99) if (dx, dy) == (0, 0) else rng.uniform(0.05, 0.6)
                        head[0, i, 5 + c] = rng.uniform(0.5, 0.99)
            base += gh * gw
    return head


def run_post(params: dict[str, Any], head: np.ndarray, frame_hw: tuple[int, int],
             geometry: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sess = ort.InferenceSession(build_graph("post.yolox", params).SerializeToString(), providers=[CPU])
    boxes, scores, class_ids = sess.run(["boxes", "scores", "class_ids"], {
        "output": head, "frame_size": np.array(frame_hw, np.int64), "geometry": np.array(geometry, np.float32)})
    return boxes, scores, class_ids


def assert_same_detections(boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, dets: np.ndarray) -> None:
    assert boxes.shape == (len(dets), 4), (boxes.shape, dets.shape)
    np.testing.assert_array_equal(class_ids, dets[:, 5].astype(np.int64))
    np.testing.assert_allclose(scores, dets[:, 4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(boxes, dets[:, :4], atol=2e-3, rtol=1e-5)


@pytest.mark.parametrize("frame_hw", [(480, 640), (720, 1280), (1080, 810)])
@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("class_agnostic", [True, False])
def test_yolox_decode_and_nms_match_the_demo_through_a_letterbox(frame_hw: tuple[int, int], kind: str,
                                                                  class_agnostic: bool) -> None:
    size = (320, 320)
    r = min(size[0] / frame_hw[0], size[1] / frame_hw[1])
    pad = (0.0, 0.0) if frame_hw[0] < 1000 else (float((320 - round(frame_hw[1] * r)) // 2), 0.0)  # also centred
    make = random_head if kind == "random" else structured_head
    head = make(*size, classes=3, seed=frame_hw[0] + class_agnostic)
    dets = yolox_reference(head, size, r, pad, frame_hw, class_agnostic)
    out = run_post({"width": 320, "height": 320, "class_agnostic": class_agnostic}, head, frame_hw,
                   [r, r, pad[0], pad[1], 0, 0])
    assert len(dets) >= (3 if kind == "structured" else 20)  # the comparison has something in it
    assert_same_detections(*out, dets)


@pytest.mark.parametrize("frame_hw", [(200, 300), (257, 130)])
def test_native_size_grids_follow_the_frame_padded_to_a_multiple(frame_hw: tuple[int, int]) -> None:
    padded = (-(-frame_hw[0] // 32) * 32, -(-frame_hw[1] // 32) * 32)
    head = structured_head(*padded, classes=2, seed=frame_hw[1])
    dets = yolox_reference(head, padded, 1.0, (0.0, 0.0), frame_hw, True)
    out = run_post({"width": 0, "height": 0, "multiple": 32}, head, frame_hw, [1, 1, 0, 0, 0, 0])
    assert len(dets) >= 3
    assert_same_detections(*out, dets)


def test_logits_are_sigmoided_and_thresholds_apply() -> None:
    head = random_head(128, 128, classes=4, seed=3)
    logits = head.copy()
    p = np.clip(head[..., 4:], 1e-6, 1 - 1e-6)
    logits[..., 4:] = np.log(p / (1 - p))
    dets = yolox_reference(head, (128, 128), 1.0, (0.0, 0.0), (128, 128), True, nms_thr=0.3, score_thr=0.3)
    out = run_post({"width": 128, "height": 128, "logits": True, "iou_threshold": 0.3, "score_threshold": 0.3},
                   logits, (128, 128), [1, 1, 0, 0, 0, 0])
    assert len(dets) >= 5
    assert_same_detections(*out, dets)


def test_legacy_plus_one_changes_what_nms_keeps_on_small_boxes() -> None:
    """Two 4x4 boxes offset by 1 px: IoU 0.6 exactly (suppressed at 0.5), but 0.667 with +1 areas; at a 0.62
    bound only the +1 areas suppress the second, as py_cpu_nms does."""
    head = np.zeros((1, n_cells(32, 32), 6), np.float32)
    head[..., 2:4] = -10.0
    for i, (dx, score) in enumerate(((0.5, 0.9), (-0.375, 0.8))):  # centres 4 and 5 px: cells 0 and 1, stride 8
        head[0, i] = [dx, 0.5, np.log(0.5), np.log(0.5), score, 1.0]
    want_plus = yolox_reference(head, (32, 32), 1.0, (0, 0), (32, 32), True, nms_thr=0.62, score_thr=0.1)
    plus = run_post({"width": 32, "height": 32, "iou_threshold": 0.62}, head, (32, 32), [1, 1, 0, 0, 0, 0])
    plain = run_post({"width": 32, "height": 32, "iou_threshold": 0.62, "legacy_plus_one": False}, head, (32, 32),
                     [1, 1, 0, 0, 0, 0])
    assert len(want_plus) == 1 and len(plus[0]) == 1
    assert len(plain[0]) == 2


def test_nothing_above_threshold_gives_empty_outputs() -> None:
    head = random_head(64, 64, classes=2, seed=0)
    head[..., 4] = 0.0
    boxes, scores, class_ids = run_post({"width": 64, "height": 64}, head, (64, 64), [1, 1, 0, 0, 0, 0])
    assert boxes.shape == (0, 4) and scores.shape == (0,) and class_ids.shape == (0,)


def test_threshold_boundaries_follow_the_demo_score_strictly_over_iou_kept_at_equal() -> None:
    """multiclass_nms keeps scores > score_thr; nms keeps ovr <= nms_thr: a score equal to the bound is dropped,
    an IoU equal to the bound is kept (ONNX NonMaxSuppression as onnxruntime implements it agrees)."""
    head = np.zeros((1, n_cells(32, 32), 6), np.float32)
    head[..., 2:4] = -10.0
    head[0, 0] = [0.5, 0.5, 0.0, 0.0, 0.9, 1.0]  # [0, 0, 8, 8]
    head[0, 1] = [-0.5, 0.25, 0.0, np.log(0.5), 0.8, 1.0]  # [0, 0, 8, 4]: IoU 32 / 64 = 0.5 exactly
    head[0, 2] = [0.5, 0.5, 0.0, 0.0, 0.5, 1.0]  # a score of exactly 0.5, at cell (2, 0): [16, 0, 24, 8]
    params = {"width": 32, "height": 32, "iou_threshold": 0.5, "score_threshold": 0.5, "legacy_plus_one": False}
    boxes, scores, _ = run_post(params, head, (32, 32), [1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(scores, [0.9, 0.8], rtol=1e-6)
    np.testing.assert_allclose(boxes, [[0, 0, 8, 8], [0, 0, 8, 4]], atol=1e-5)


@pytest.mark.parametrize("frame_hw", [(480, 640), (300, 200)])
def test_an_already_decoded_head_skips_the_grid(frame_hw: tuple[int, int]) -> None:
    """decode_in_inference exports (and YOLOv5-style outputs) carry (cx, cy, w, h) in input pixels already."""
    head = structured_head(320, 320, classes=3, seed=frame_hw[1])
    r = min(320 / frame_hw[0], 320 / frame_hw[1])
    dets = yolox_reference(head, (320, 320), r, (0.0, 0.0), frame_hw, False)
    decoded = demo_postprocess(head, (320, 320)).astype(np.float32)
    out = run_post({"width": 320, "height": 320, "decoded": True, "class_agnostic": False}, decoded, frame_hw,
                   [r, r, 0, 0, 0, 0])
    assert len(dets) >= 3
    assert_same_detections(*out, dets)
