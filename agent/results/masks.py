"""Result kind `masks`: one foreground mask per sample at frame size, served as run lengths (COCO's
column-major counts) with its area.

Judged per sample against the package's own mask: IoU on EVERY sample against `min_mask_iou` (the worst
sample named with its own IoU, the mean only reported beside it); two empty masks count as 1.0, and are
counted and warned about, since agreeing on nothing proves little.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.proof.parity import Finding
from agent.results import parse
from agent.results.fields import Field, check_fields, field_tensors, setting
from agent.vocabulary.kinds import Floor, Option
from agent.results.floors import (
    Figures, count_mismatch, json_figures, merge_floors, read_pairs, sample_list, under,
)
from agent.vocabulary.decoders import rle as row_major_rle

NAME = "masks"
FIELDS: tuple[Field, ...] = (
    Field("mask", True, (2,), "mask", "[H, W] at frame size: 0/1 (bool, uint8), class ids, or float probabilities "
                                      "with postprocess.result.threshold"),
)
FLOORS: tuple[Floor, ...] = (
    Floor("min_mask_iou", 0.9, "IoU of the served mask with the package's"),
)
DEFAULT_FLOORS: Mapping[str, float] = MappingProxyType({f.key: f.default for f in FLOORS})
# values read from positions in a raw layout: a decoder building it needs the package's answers to be proven
DECODED = True
READS: tuple[str, ...] = ("masks", "segmentation")
# postprocess.result keys this kind reads besides its fields (and `kind`)
OPTIONS: tuple[Option, ...] = (
    Option("threshold", {"type": "number"}, "a float mask is foreground where over it (required for float masks)"),
    Option("class_id", {"type": "integer", "minimum": 0},
           "a class-id mask is foreground where equal to it; default: non-zero"),
)


@dataclass(frozen=True, eq=False)
class Mask:
    """One sample's foreground, (H, W) bool."""

    foreground: np.ndarray

    @property
    def size(self) -> tuple[int, int]:
        return int(self.foreground.shape[0]), int(self.foreground.shape[1])

    @property
    def area(self) -> int:
        return int(np.count_nonzero(self.foreground))


# ---------------------------------------------------------------- tensors

def check(tensors: Mapping[str, np.ndarray], spec: Any) -> list[str]:
    problems = check_fields(tensors, spec, FIELDS, NAME)
    if problems:
        return problems
    m = field_tensors(tensors, spec, FIELDS)["mask"]
    if m.dtype.kind == "f" and setting(spec, "threshold") is None:
        problems.append(f"result {NAME} field 'mask' holds {m.dtype} probabilities: declare "
                        "postprocess.result.threshold (foreground where the value is over it)")
    if m.size == 0:
        problems.append(f"result {NAME} field 'mask' has shape {list(m.shape)}: a frame-size mask wanted")
    frame = setting(spec, "frame_size")  # (h, w) when the caller knows the frame
    if frame is not None and m.ndim == 2 and tuple(m.shape) != tuple(frame):
        problems.append(f"result {NAME} field 'mask' has shape {list(m.shape)}: the frame is {list(frame)} (h, w); "
                        "a mask is served at frame size (the post graph takes `frame_size` to resize it)")
    return problems


def foreground(tensors: Mapping[str, np.ndarray], spec: Any) -> np.ndarray:
    """The (H, W) bool foreground: values over `threshold` (float), equal to `class_id` (when declared),
    else non-zero."""
    m = np.asarray(field_tensors(tensors, spec, FIELDS)["mask"])
    if m.dtype.kind == "f":
        threshold = setting(spec, "threshold")
        if threshold is None:
            raise BundleError(f"key postprocess.result.threshold: a {m.dtype} mask needs one")
        above: np.ndarray = np.nan_to_num(m, nan=-np.inf) > float(threshold)
        return above
    class_id = setting(spec, "class_id")
    chosen: np.ndarray = m == int(class_id) if class_id is not None else m != 0
    return chosen


def column_major_counts(fg: np.ndarray) -> list[int]:
    """COCO's uncompressed counts: runs down the columns, starting with a run of zeros."""
    counts: list[int] = row_major_rle(np.ascontiguousarray(fg.T))["counts"]
    return counts


def compact(tensors: Mapping[str, np.ndarray], spec: Any, labels: Sequence[str] = (),
            charset: Sequence[str] = ()) -> dict[str, Any]:
    fg = foreground(tensors, spec)
    h, w = int(fg.shape[0]), int(fg.shape[1])
    return {"type": NAME, "size": [h, w], "rle": {"size": [h, w], "counts": column_major_counts(fg)},
            "area": int(np.count_nonzero(fg))}


# ---------------------------------------------------------------- values

def coco_string_counts(s: str) -> list[int]:
    """pycocotools' compressed counts string (rleToString) -> run lengths, as its rleFrString reads it."""
    counts: list[int] = []
    p = 0
    while p < len(s):
        x = k = 0
        more = True
        while more:
            if p >= len(s):
                raise BundleError(f"a compressed RLE string ends inside a count at character {p}")
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def decode_rle(counts: Sequence[int], size: tuple[int, int], order: str, where: str) -> np.ndarray:
    """(H, W) bool from run lengths that start with zeros; `order` "column" (COCO) or "row" (the vocabulary)."""
    h, w = size
    if any(c < 0 for c in counts):
        raise BundleError(f"field {where}counts: run lengths must not be negative")
    if sum(counts) != h * w:
        raise BundleError(f"field {where}counts: the runs cover {sum(counts)} pixels, size {h}x{w} has {h * w}")
    values = np.arange(len(counts)) % 2 == 1
    flat = np.repeat(values, np.asarray(counts, dtype=np.int64))
    return flat.reshape((w, h)).T if order == "column" else flat.reshape((h, w))


def normalise(result: Mapping[str, Any]) -> Mask:
    """A `masks` result (rle counts column-major like COCO unless `rle.order` is "row"; counts a list or
    pycocotools' compressed string) or the vocabulary's `segmentation` result with an rle mask (row-major)."""
    t = parse.result_type(result, READS, NAME)
    if t == "segmentation":
        if result.get("mask") is None:
            raise BundleError("field mask: a segmentation result without an rle mask cannot be judged as masks "
                              "(declare postprocess.mask: rle)")
        r, where, order = parse.mapping(result["mask"], "mask"), "mask.", "row"
    else:
        r, where = parse.mapping(parse.field(result, "rle", ""), "rle"), "rle."
        order = str(r.get("order", "column"))
        if order not in ("column", "row"):
            raise BundleError(f"field rle.order: 'column' or 'row' wanted, found {order!r}")
    size = _size(r.get("size", result.get("size")), f"{where}size")
    if t == "masks" and "size" in result and _size(result["size"], "size") != size:
        raise BundleError(f"field size: {result['size']} disagrees with rle.size {list(size)}")
    raw = parse.field(r, "counts", where)
    if isinstance(raw, str):
        counts = coco_string_counts(raw)
    elif isinstance(raw, list):
        counts = [parse.integer(c, f"{where}counts[{i}]") for i, c in enumerate(raw)]
    else:
        raise BundleError(f"field {where}counts: a list of run lengths or a COCO string wanted, found "
                          f"{type(raw).__name__}")
    mask = Mask(decode_rle(counts, size, order, where))
    if t == "masks" and "area" in result and parse.integer(result["area"], "area") != mask.area:
        raise BundleError(f"field area: {result['area']} disagrees with the {mask.area} pixels of the rle")
    return mask


def _size(v: Any, where: str) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2:
        raise BundleError(f"field {where}: [height, width] wanted, found {v!r}")
    h, w = (parse.integer(x, f"{where}[{i}]") for i, x in enumerate(v))
    if h < 0 or w < 0:
        raise BundleError(f"field {where}: {v} is not a size")
    return h, w


# ---------------------------------------------------------------- fidelity

def fidelity(served: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
             floors: Mapping[str, Any] | None = None, stage: str = "post") -> tuple[Figures, list[Finding]]:
    """Figures: mean_iou (reported, never judged), min_iou, worst_sample, samples_under_floor, both_empty
    (samples where both masks are empty, counted as IoU 1.0), size_mismatches, warnings (list of str)."""
    f = merge_floors(NAME, DEFAULT_FLOORS, floors)
    mismatch = count_mismatch(NAME, served, answers, stage, normalise)
    if mismatch:
        return {"worst_sample": None, "warnings": []}, [mismatch]
    ious: dict[int, float] = {}  # by sample index
    notes: dict[int, str] = {}
    both_empty: list[int] = []
    size_mismatch: list[int] = []
    pairs, unreadable = read_pairs(NAME, normalise, served, answers, stage)
    for i, s, a in pairs:
        if s.size != a.size:
            ious[i] = 0.0
            size_mismatch.append(i)
            notes[i] = f"served size {list(s.size)}, package size {list(a.size)}"
            continue
        union = int(np.count_nonzero(s.foreground | a.foreground))
        if union == 0:
            both_empty.append(i)
            ious[i] = 1.0
        else:
            ious[i] = int(np.count_nonzero(s.foreground & a.foreground)) / union
        notes[i] = f"served area {s.area}, package area {a.area}"
    floor = f["min_mask_iou"]
    worst = min(ious, key=lambda i: (ious[i], i)) if ious else None
    failing = [i for i, v in ious.items() if v < floor]
    mean = float(np.mean(list(ious.values()))) if ious else None
    warnings = []
    if both_empty:
        warnings.append(f"{len(both_empty)} of {len(ious)} samples have an empty mask on both sides, counted as IoU "
                        f"1.0: samples {sample_list(both_empty)}")
    figures: Figures = {
        "mean_iou": mean, "min_iou": None if worst is None else ious[worst],
        "worst_sample": worst, "samples_under_floor": len(failing), "both_empty": len(both_empty),
        "size_mismatches": len(size_mismatch), "warnings": warnings,
    }
    findings = []
    if worst is not None and failing:
        findings.append(under("mask IoU of one sample", ious[worst], floor, stage, worst,
                              f"{notes[worst]}; {len(failing)} of {len(ious)} samples under the floor: "
                              f"{sample_list(failing)}; mean IoU over all samples {mean:.4g}"))
    return json_figures(figures), unreadable + findings


def golden_warnings(answers: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every package mask empty: IoU cannot fail (an empty served mask agrees); some empty: warned too."""
    empty = [i for i, a in enumerate(answers) if normalise(a).area == 0]
    if answers and len(empty) == len(answers):
        return ["every golden sample's package mask is empty: mask IoU cannot fail on this set (an empty served "
                "mask agrees with it); add frames with the object"]
    if empty:
        return [f"{len(empty)} of {len(answers)} golden package masks are empty (samples {sample_list(empty)}): "
                "there an empty served mask counts as IoU 1.0"]
    return []
