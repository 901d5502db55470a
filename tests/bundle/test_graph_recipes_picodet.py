"""post.picodet (agent/bundle/graphs/post_picodet.py) in a real session against PP-PicoDet's own decode, written
in numpy from rapid-layout 0.4.2's PPPostProcess (rapid_layout/utils/post_prepross.py, Apache-2.0): centres
on np.arange(size / stride) grids, DFL softmax expectation x stride, the best nms_top_k cells per stride,
per class the candidate_size best over conf_thres, hard_nms, clip to the input, divide by the stretch scale."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnxruntime as ort  # noqa: E402

from agent.bundle.graphs import build_graph  # noqa: E402
from agent.errors import UsageError  # noqa: E402
from agent.proof.terms import CPU  # noqa: E402

STRIDES = (8, 16, 32, 64)
IN_H, IN_W = 800, 608
SCORES = [f"cls_{s}" for s in STRIDES]
DISTS = [f"reg_{s}" for s in STRIDES]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _iou_of(boxes0: np.ndarray, boxes1: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    lt, rb = np.maximum(boxes0[..., :2], boxes1[..., :2]), np.minimum(boxes0[..., 2:], boxes1[..., 2:])

    def area(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        hw = np.clip(b - a, 0.0, None)
        return hw[..., 0] * hw[..., 1]
    overlap = area(lt, rb)
    return overlap / (area(boxes0[..., :2], boxes0[..., 2:]) + area(boxes1[..., :2], boxes1[..., 2:]) - overlap + eps)


def _hard_nms(box_scores: np.ndarray, iou_thres: float, top_k: int, candidate_size: int = 200) -> np.ndarray:
    scores, boxes = box_scores[:, -1], box_scores[:, :-1]
    picked: list[int] = []
    indexes = np.argsort(scores)[-candidate_size:]
    while len(indexes) > 0:
        current = indexes[-1]
        picked.append(int(current))
        if 0 < top_k == len(picked) or len(indexes) == 1:
            break
        indexes = indexes[:-1]
        iou = _iou_of(boxes[indexes, :], np.expand_dims(boxes[current, :], axis=0))
        indexes = indexes[iou <= iou_thres]
    return box_scores[picked, :]


def pp_postprocess(scores: list[np.ndarray], dists: list[np.ndarray], frame_hw: tuple[int, int],
                   conf: float = 0.5, iou: float = 0.5) -> list[tuple[int, float, list[float]]]:
    """-> (class, score, box in frame pixels) per kept box, as PPPostProcess.__call__ for one image."""
    reg_max = dists[0].shape[-1] // 4 - 1
    decode_boxes, select_scores = [], []
    for stride, dist, score in zip(STRIDES, dists, scores):
        dist, score = dist[0], score[0]
        h_range, w_range = np.arange(IN_H / stride), np.arange(IN_W / stride)
        ww, hh = np.meshgrid(w_range, h_range)
        ct_row, ct_col = (hh.flatten() + 0.5) * stride, (ww.flatten() + 0.5) * stride
        center = np.stack((ct_col, ct_row, ct_col, ct_row), axis=1)
        d = _softmax(dist.reshape((-1, reg_max + 1))) * np.arange(reg_max + 1)[None]
        d = np.sum(d, axis=1).reshape((-1, 4)) * stride
        top = np.argsort(score.max(axis=1))[::-1][:1000]
        decode_boxes.append(center[top] + np.asarray([-1, -1, 1, 1]) * d[top])
        select_scores.append(score[top])
    bboxes, confidences = np.concatenate(decode_boxes), np.concatenate(select_scores)
    out = []
    sx, sy = np.float32(IN_W / float(frame_hw[1])), np.float32(IN_H / float(frame_hw[0]))
    for c in range(confidences.shape[1]):
        probs = confidences[:, c]
        mask = probs > conf
        if not mask.any():
            continue
        kept = _hard_nms(np.concatenate([bboxes[mask], probs[mask].reshape(-1, 1)], axis=1), iou, 100)
        for row in kept:
            b = row[:4].copy()
            b[[0, 2]] = b[[0, 2]].clip(0, IN_W) / sx
            b[[1, 3]] = b[[1, 3]].clip(0, IN_H) / sy
            out.append((c, float(row[4]), [float(v) for v in b]))
    return out


def head(seed: int, classes: int = 10, hot: int = 40) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Class scores mostly low with `hot` confident clusters (overlapping neighbours, so NMS has work)."""
    rng = np.random.default_rng(seed)
    scores, dists = [], []
    for s in STRIDES:
        n = int(np.ceil(IN_H / s) * np.ceil(IN_W / s))
        logits = rng.normal(-4.0, 1.5, (1, n, classes)).astype(np.float32)
        for _ in range(hot // len(STRIDES)):
            i, c = int(rng.integers(0, n - 3)), int(rng.integers(0, classes))
            logits[0, i:i + 3, c] = rng.uniform(0.0, 3.0, 3)
        scores.append((1 / (1 + np.exp(-logits))).astype(np.float32))
        dists.append(rng.normal(0.0, 2.0, (1, n, 32)).astype(np.float32))
    return scores, dists


def session(**params: object) -> ort.InferenceSession:
    model = build_graph("post.picodet", {"scores": ",".join(SCORES), "distributions": ",".join(DISTS), **params})
    return ort.InferenceSession(model.SerializeToString(), providers=[CPU])


def run(sess: ort.InferenceSession, scores: list[np.ndarray], dists: list[np.ndarray],
        frame_hw: tuple[int, int]) -> list[tuple[int, float, list[float]]]:
    geometry = np.asarray([IN_W / frame_hw[1], IN_H / frame_hw[0], 0, 0, 0, 0], np.float32)  # pre.stretch's
    feeds = {**dict(zip(SCORES, scores)), **dict(zip(DISTS, dists)),
             "frame_size": np.asarray(frame_hw, np.int64), "geometry": geometry}
    boxes, sc, cls = sess.run(None, feeds)
    return [(int(c), float(s), [float(v) for v in b]) for b, s, c in zip(boxes, sc, cls)]


def _same(got: list[tuple[int, float, list[float]]], want: list[tuple[int, float, list[float]]]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    g, w = sorted(got, key=lambda t: (t[0], -t[1])), sorted(want, key=lambda t: (t[0], -t[1]))
    for (cg, sg, bg), (cw, sw, bw) in zip(g, w):
        assert cg == cw and abs(sg - sw) < 1e-6
        np.testing.assert_allclose(bg, bw, atol=0.02, rtol=1e-5)


@pytest.mark.parametrize("frame_hw", [(800, 608), (480, 360), (1280, 960), (600, 800)])
def test_post_picodet_equals_rapid_layouts_own_decode_at_each_frame_size(frame_hw: tuple[int, int]) -> None:
    sess = session()
    for seed in range(3):
        scores, dists = head(seed)
        want = pp_postprocess(scores, dists, frame_hw)
        assert want, "the synthetic head gave the package's decode nothing to keep"
        _same(run(sess, scores, dists, frame_hw), want)


def test_post_picodet_keeps_the_packages_200_candidates_per_class() -> None:
    """A class with more than 200 candidates over the threshold: the package's hard_nms only looks at its best
    200, so a low-scoring isolated box beyond them is dropped there and must be dropped here too."""
    scores, dists = head(7, hot=0)
    scores[0][0, :, 0] = np.linspace(0.6, 0.99, scores[0].shape[1], dtype=np.float32)  # 7600 candidates, class 0
    want = pp_postprocess(scores, dists, (800, 608))
    _same(run(session(), scores, dists, (800, 608)), want)
    uncapped = run(session(candidates=100000), scores, dists, (800, 608))
    assert len(uncapped) != len(want), "this head does not tell the 200-candidate cap from none"


def test_post_picodet_refuses_output_lists_that_do_not_match_the_strides() -> None:
    with pytest.raises(UsageError, match=r"--param scores: expected 4 output names"):
        build_graph("post.picodet", {"scores": "a,b", "distributions": ",".join(DISTS)})
