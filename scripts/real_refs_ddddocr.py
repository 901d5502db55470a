"""Reference sample sets for ddddocr 1.6.1's captcha recogniser (common_old.onnx), made by the package's OWN code.

Runs inside the references venv (ddddocr installed; nothing of the agent imported). Frames are drawn here,
deterministically (seeded): captcha-like lines of 4 to 6 letters and digits in OpenCV's Hershey fonts, on a
light textured background with a few noise lines, heights 28 to 96 px. Each frame is written as PNG and its
bytes given to the package's public `DdddOcr(show_ad=False).classification(bytes)` (its PIL decode, LANCZOS to
height 64 keeping the aspect, convert('L'), /255, its session, its time-major CTC decode); the string it returns
is the answer. The tensor its session was given is recorded through a wrapper on the package's session.
The model's output is time-major, `[T, 1, 6000+]` (the ONNX file declares `[1, seqlen]`).
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path
from typing import Any

import cv2
import numpy as np

PACKAGE = "ddddocr 1.6.1"
SPLITS = {"calibration": 8, "golden": 12, "heldout": 150}
SEEDS = {"calibration": 4100, "golden": 5100, "heldout": 6100}
ALPHABET = string.ascii_lowercase + string.digits
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX)
PRODUCED_BY = ("scripts/real_refs_ddddocr.py: ddddocr.DdddOcr(show_ad=False).classification(png_bytes) of ddddocr "
               "1.6.1 with its defaults (common_old.onnx, the old charset), one frame per call")


def draw(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """An RGB captcha-like frame and the text drawn on it."""
    text = "".join(rng.choice(list(ALPHABET), int(rng.integers(4, 7))))
    font = FONTS[int(rng.integers(len(FONTS)))]
    scale = float(rng.uniform(0.8, 2.2))
    thick = int(rng.integers(1, 4))
    (tw, th), base = cv2.getTextSize(text, font, scale, thick)
    pad_x, pad_y = int(rng.integers(6, 20)), int(rng.integers(4, 14))
    h, w = th + base + 2 * pad_y, tw + 2 * pad_x
    bg = rng.integers(200, 256, 3)
    img = np.clip(bg[None, None, :] + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)
    colour = tuple(int(c) for c in rng.integers(0, 120, 3))
    cv2.putText(img, text, (pad_x, pad_y + th), font, scale, colour, thick, cv2.LINE_AA)
    for _ in range(int(rng.integers(0, 3))):
        p0 = (int(rng.integers(w)), int(rng.integers(h)))
        p1 = (int(rng.integers(w)), int(rng.integers(h)))
        cv2.line(img, p0, p1, tuple(int(c) for c in rng.integers(60, 200, 3)), 1, cv2.LINE_AA)
    return img, text


class _Recording:
    """The package's session, its input tensors recorded."""

    def __init__(self, session: Any) -> None:
        self.session, self.fed = session, []

    def get_inputs(self) -> Any:
        return self.session.get_inputs()

    def run(self, names: Any, feeds: dict[str, np.ndarray]) -> Any:
        self.fed.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.session.run(names, feeds)


def build(d: Path) -> dict[str, Any]:
    import ddddocr

    ocr = ddddocr.DdddOcr(show_ad=False)
    engine = ocr.ocr_engine
    charset = list(engine.charset_manager.get_charset())
    if any("\n" in c for c in charset) or charset[0] != "":
        raise SystemExit("ddddocr charset: an entry holds a newline, or id 0 is not the blank ''")
    (d / "charset.txt").write_text("\n".join(charset) + "\n", encoding="utf-8")
    rec = _Recording(engine.session)
    engine.session = rec
    summary: dict[str, Any] = {}
    for split, count in SPLITS.items():
        out, tmp = d / split, d / f"{split}.part"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = d / f"{split}-inputs"
        shutil.rmtree(tensors, ignore_errors=True)
        tensors.mkdir()
        results, drawn, sizes = [], [], []
        for i in range(count):
            frame, text = draw(np.random.default_rng(SEEDS[split] + i))
            path = tmp / f"{i:04d}.png"
            if not cv2.imwrite(str(path), cv2.cvtColor(frame, cv2.COLOR_RGB2BGR)):
                raise SystemExit(f"{path}: cv2.imwrite failed")
            rec.fed.clear()
            got = ocr.classification(path.read_bytes())
            if len(rec.fed) != 1:
                raise SystemExit(f"ddddocr {split} {i}: {len(rec.fed)} session runs")
            np.save(tensors / f"{i:04d}.npy", next(iter(rec.fed[0].values())))
            results.append({"type": "text", "text": got})
            drawn.append(text)
            sizes.append(frame.shape[:2])
        answers = {"kind": "text", "package": PACKAGE, "produced_by": PRODUCED_BY, "results": results}
        (tmp / "answers.json").write_text(json.dumps(answers, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        (d / f"{split}.drawn.json").write_text(json.dumps(drawn) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        summary[split] = {"frames": count, "heights": [min(s[0] for s in sizes), max(s[0] for s in sizes)],
                          "widths": [min(s[1] for s in sizes), max(s[1] for s in sizes)],
                          "package_equals_drawn": sum(r["text"] == t for r, t in zip(results, drawn))}
    return summary
