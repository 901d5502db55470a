"""Issue 42: a real time-major CTC recogniser served equal to its package with no edit of the model.

ddddocr 1.6.1 (MIT) ships its captcha recogniser `common_old.onnx` in its wheel: input [1, 1, 64, W], output
`387` TIME-MAJOR [T, 1, 8210] (the file declares [1, seqlen]). Its package resizes with PIL LANCZOS to height 64
keeping the aspect (`int(W * (64 / H))`), `convert('L')`, / 255, and decodes `output[:, 0, :]` greedily. Here
the pre stage is the `pre.fit_height` recipe, the post stage `post.ctc`, and the spec declares
`outputs.387.batch_axis: 1`; `edge-agent run` serves held-out captchas whose strings must equal what the
package's own `DdddOcr(show_ad=False).classification(bytes)` returned in its separate venv
(`scripts/real_models.py references ddddocr`, scripts/real_refs_ddddocr.py) on >= 98 % of frames. Without the
declaration the build is refused naming the key. Skipped when the cache lacks the model or references.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from agent.bundle.graphs import write_graph
from tests.e2e.test_real_models import BUILT, CACHE, MIN_AGREEMENT, REPEATS, SPECS, build_key, cli, keep_built, manifest_of, selftest

NAME = "ddddocr"
DIR = CACHE / NAME
OUTPUT = "387"
RESULTS = CACHE / "results-timemajor.json"
pytestmark = [pytest.mark.slow, pytest.mark.real]


def require() -> None:
    for need, how in ((DIR / "model.onnx", "fetch"), (DIR / "references.json", "references")):
        if not need.exists():
            pytest.skip(f"{need} is missing: run `python scripts/real_models.py {how} {NAME}`")


def record(key: str, value: Any) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    tmp = RESULTS.with_suffix(f".{os.getpid()}.part")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    tmp.replace(RESULTS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("timemajor")


def graphs(workdir: Path) -> tuple[Path, Path]:
    pre, post = workdir / "pre.onnx", workdir / "post.onnx"
    if not post.exists():
        # height 64, int() width, PIL LANCZOS, convert('L'), / 255: the recipe's defaults
        write_graph("pre.fit_height", pre, {"input_name": "input1"})
        write_graph("post.ctc", post, {"input": OUTPUT})
    return pre, post


def create_args(workdir: Path, spec: Path, out: Path, *extra: str) -> list[str]:
    pre, post = graphs(workdir)
    return ["bundle", "create", "--model", str(DIR / "model.onnx"), "--spec", str(spec), "--pre-graph", str(pre),
            "--post-graph", str(post), "--charset", str(DIR / "charset.txt"), "--calibration", str(DIR / "calibration"),
            "--golden", str(DIR / "golden"), "--out", str(out), *extra]


_BUILT: dict[str, Path] = {}


def bundle(workdir: Path) -> Path:
    require()
    if NAME in _BUILT:
        return _BUILT[NAME]
    out = workdir / "bundle"
    args = create_args(workdir, SPECS / f"{NAME}.yaml", out, "--heldout", str(DIR / "heldout"))
    cached = BUILT / f"{NAME}-{build_key(args, out)}"
    if (cached / "bundle.yaml").exists():
        _BUILT[NAME] = cached
        return cached
    t0 = time.monotonic()
    r = cli(*args)
    assert r.returncode == 0, f"bundle create failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    record("build", {"seconds": round(time.monotonic() - t0, 1), "load": os.getloadavg()})
    keep_built(out, cached)
    _BUILT[NAME] = out
    return out


def test_pre_fit_height_reproduces_the_package_input_tensors_bit_for_bit(workdir: Path) -> None:
    """PIL LANCZOS to height 64 (aspect kept, int() width) and convert('L'), as an ONNX graph, against the tensor
    the package's session was given, on every frame of every split (heights 31 to 99: shrinking and growing)."""
    import cv2
    import onnxruntime as ort

    require()
    pre = ort.InferenceSession(str(graphs(workdir)[0]), providers=["CPUExecutionProvider"])
    frames, worst = 0, 0.0
    for split in ("calibration", "golden", "heldout"):
        for png in sorted((DIR / split).glob("*.png")):
            rgb = cv2.cvtColor(cv2.imread(str(png), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            ours = pre.run(None, {"frame": rgb})[0]
            theirs = np.load(DIR / f"{split}-inputs" / f"{png.stem}.npy")
            assert ours.shape == theirs.shape, f"{split}/{png.name}: {ours.shape} vs package {theirs.shape}"
            worst = max(worst, float(np.max(np.abs(ours - theirs))))
            frames += 1
    record("pre_graph_vs_package", {"frames": frames, "max_abs": worst})
    assert frames >= 170 and worst == 0.0, (frames, worst)


def test_bundle_declares_the_batch_axis_and_keeps_the_packages_model(workdir: Path) -> None:
    b = bundle(workdir)
    m = manifest_of(b)
    assert [(o["name"], o.get("batch_axis")) for o in m["outputs"]] == [(OUTPUT, 1)]
    source = json.loads((DIR / "source.json").read_text())
    assert m["source"]["sha256"] == source["sha256"]  # the package's file, not an edited one
    quality = {v["name"]: v["quality"] for v in m["variants"]}
    record("variants", quality)
    assert all(q.get("heldout_package_exact_match", 0) >= MIN_AGREEMENT for q in quality.values()), quality


def test_served_strings_equal_the_package_on_held_out_captchas(workdir: Path) -> None:
    b = bundle(workdir)
    frames = DIR / "heldout"
    n = len(list(frames.glob("*.png")))
    cfg = workdir / "run.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(workdir / "run-state"), "bundle": str(b),
                                   "source": {"type": "folder", "path": str(frames)},
                                   "output": {"stdout": True}, "log": {"level": "warning", "json": True}}))
    t0 = time.monotonic()
    r = cli("run", "--config", str(cfg), "--max-frames", str(n), timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    got = {ln.get("item") or ln["source"]: ln["result"]["text"] for ln in lines}
    want = json.loads((frames / "answers.json").read_text(encoding="utf-8"))["results"]
    names = sorted(p.name for p in frames.glob("*.png"))
    assert len(got) == n == len(want)
    equal = sum(got[p] == a["text"] for p, a in zip(names, want))
    wrong = [(p, got[p], a["text"]) for p, a in zip(names, want) if got[p] != a["text"]][:5]
    record("served_heldout", {"frames": n, "equal": equal, "wrong": wrong, "seconds": round(time.monotonic() - t0, 1),
                              "load": os.getloadavg()})
    print(f"\nddddocr: edge-agent run served the package's string on {equal}/{n} held-out captchas")
    assert equal / n >= MIN_AGREEMENT, wrong


def test_passes_cold_selftests(workdir: Path) -> None:
    b = bundle(workdir)
    variant = manifest_of(b)["variants"][0]["name"]  # the package's model is already INT8: served as it is
    failures = []
    for attempt in range(REPEATS):
        report = selftest(b, workdir / f"cold-{attempt}", "--variant", variant, "--latency-runs", "3")
        tested = [c for c in report["candidates"] if c["variant"] == variant and c["status"] == "tested"]
        if not (tested and tested[0]["passed"]):
            failures.append(f"attempt {attempt}: {tested[0]['reasons'] if tested else report['reason']}")
    record("cold_selftests", {"passed": REPEATS - len(failures), "of": REPEATS, "failures": failures})
    assert not failures, failures


def test_without_the_declaration_the_build_is_refused_naming_the_batch_axis_key(workdir: Path) -> None:
    require()
    spec = yaml.safe_load((SPECS / f"{NAME}.yaml").read_text())
    del spec["outputs"]
    path = workdir / "no-batch-axis.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = cli(*create_args(workdir, path, workdir / "refused"))
    assert r.returncode != 0 and not (workdir / "refused").exists()
    assert f"declare `outputs.{OUTPUT}.batch_axis: 1`" in r.stderr, r.stderr[-2000:]
