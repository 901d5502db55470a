"""Result kind `masks`: IoU judged on every sample (the worst named with its own IoU, never the mean),
two empty masks counted and warned, COCO's column-major RLE (and its compressed strings) and the
vocabulary's row-major segmentation mask both read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.errors import BundleError
from agent.results import masks


def _mask(h: int = 40, w: int = 60, box: tuple[int, int, int, int] | None = (5, 10, 30, 50)) -> np.ndarray:
    m = np.zeros((h, w), np.uint8)
    if box is not None:
        y0, x0, y1, x1 = box
        m[y0:y1, x0:x1] = 1
    return m


def _res(m: np.ndarray) -> dict[str, Any]:
    return masks.compact({"mask": m}, {})


def test_one_sample_at_iou_0_fails_though_the_mean_is_095_and_is_named() -> None:
    package = [_res(_mask()) for _ in range(20)]
    served = list(package)
    served[10] = _res(_mask(box=(32, 0, 40, 8)))  # disjoint from the package's mask
    figures, findings = masks.fidelity(served, package)
    assert figures["mean_iou"] == pytest.approx(0.95) and figures["mean_iou"] > 0.9  # a mean floor would pass
    [f] = findings
    assert f.sample == 10 and f.value == 0.0 and f.bound == 0.9 and f.comparison == "under"
    assert f.metric == "mask IoU of one sample" and "mean IoU over all samples 0.95" in f.detail
    assert "mask IoU of one sample = 0 under bound 0.9 on sample 10" in f.text()


def test_empty_against_empty_counts_as_agreement_and_warns() -> None:
    package = [_res(_mask()), _res(_mask(box=None))]
    figures, findings = masks.fidelity([_res(_mask()), _res(_mask(box=None))], package)
    assert findings == [] and figures["both_empty"] == 1 and figures["min_iou"] == 1.0
    assert figures["warnings"] == ["1 of 2 samples have an empty mask on both sides, counted as IoU 1.0: samples 1"]
    # an empty served mask against a real one is IoU 0, not agreement
    _, findings = masks.fidelity([_res(_mask(box=None)), _res(_mask(box=None))], package)
    assert findings and findings[0].sample == 0 and findings[0].value == 0.0


def test_compact_is_coco_column_major_and_reads_back() -> None:
    m = np.zeros((3, 4), np.uint8)
    m[0, 1] = m[1, 1] = m[2, 3] = 1
    r = masks.compact({"mask": m}, {})
    # down the columns: col0 000, col1 110, col2 000, col3 001
    assert r == {"type": "masks", "size": [3, 4], "rle": {"size": [3, 4], "counts": [3, 2, 6, 1]}, "area": 3}
    assert np.array_equal(masks.normalise(r).foreground, m.astype(bool))


def test_pycocotools_compressed_string_is_read() -> None:
    # pycocotools 2.0.11 mask.encode of this 7x9 mask gives counts b'6183K000000000OM4'
    m = np.zeros((7, 9), np.uint8)
    m[1:5, 2:8] = 1
    m[6, 0] = m[0, 8] = 1
    value = masks.normalise({"type": "masks", "size": [7, 9], "rle": {"size": [7, 9], "counts": "6183K000000000OM4"}})
    assert np.array_equal(value.foreground, m.astype(bool))
    # and one with counts over 31 (several characters per count, deltas against the count two back)
    big = np.zeros((60, 80), np.uint8)
    big[10:50, 5:70] = 1
    big[55:58, 75:79] = 1
    coco = "f9X1d" + "0" * 128 + "i:kN\\F000005"
    value = masks.normalise({"type": "masks", "size": [60, 80], "rle": {"size": [60, 80], "counts": coco}})
    assert value.area == 2612 and np.array_equal(value.foreground, big.astype(bool))


def test_normalise_accepts_the_vocabularys_segmentation_with_an_rle_mask() -> None:
    from agent.vocabulary.decoders import decode
    from agent.vocabulary.manifest import PostprocessSpec

    prob = np.zeros((1, 1, 40, 60), np.float32)
    prob[0, 0, 5:30, 10:50] = 0.9
    vocab = decode(PostprocessSpec(type="segmentation", output="p", mask="rle"), {"p": prob}, max_bytes=0)
    value = masks.normalise(vocab)
    assert np.array_equal(value.foreground, _mask().astype(bool))  # row-major, read as such
    assert masks.fidelity([vocab], [_res(_mask())])[1] == []
    no_mask = decode(PostprocessSpec(type="segmentation", output="p"), {"p": prob})
    with pytest.raises(BundleError, match="without an rle mask"):
        masks.normalise(no_mask)


def test_float_probabilities_need_a_threshold_and_class_ids_select_a_class() -> None:
    prob = np.zeros((4, 4), np.float32)
    prob[1:3, 1:3] = 0.7
    assert "postprocess.result.threshold" in masks.check({"mask": prob}, {})[0]
    assert masks.compact({"mask": prob}, {"threshold": 0.5})["area"] == 4
    assert masks.compact({"mask": prob}, {"threshold": 0.8})["area"] == 0
    ids = np.array([[0, 2], [1, 2]], np.int64)
    assert masks.compact({"mask": ids}, {"class_id": 2})["area"] == 2
    assert masks.compact({"mask": ids}, {})["area"] == 3


def test_size_mismatch_is_iou_0_and_named() -> None:
    figures, findings = masks.fidelity([_res(_mask(20, 30))], [_res(_mask())])
    assert figures["size_mismatches"] == 1 and findings[0].value == 0.0
    assert "served size [20, 30], package size [40, 60]" in findings[0].detail


def test_normalise_errors_name_the_field() -> None:
    with pytest.raises(BundleError, match=r"field rle.counts: the runs cover 5 pixels, size 2x3 has 6"):
        masks.normalise({"type": "masks", "size": [2, 3], "rle": {"size": [2, 3], "counts": [4, 1]}})
    with pytest.raises(BundleError, match=r"field area: 9 disagrees"):
        masks.normalise({"type": "masks", "size": [2, 3], "rle": {"size": [2, 3], "counts": [4, 2]}, "area": 9})
    with pytest.raises(BundleError, match=r"field rle.counts\[1\]: a whole number wanted"):
        masks.normalise({"type": "masks", "size": [2, 3], "rle": {"size": [2, 3], "counts": [4, 1.5]}})


def test_golden_set_of_empty_masks_warns() -> None:
    assert "cannot fail" in masks.golden_warnings([_res(_mask(box=None))] * 3)[0]
    assert "1 of 2" in masks.golden_warnings([_res(_mask(box=None)), _res(_mask())])[0]
    assert masks.golden_warnings([_res(_mask())]) == []
