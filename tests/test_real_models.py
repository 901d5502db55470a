"""Real pretrained models from packages on the package index, built and proven by the agent.

For each model fetched by `scripts/real_models.py` (orientation classifier, YOLOv8 layout detector,
DBNet text-detection map, stateful VAD): `bundle create` from the package's own references (FP32 and
a whole-graph INT8), then `selftest` as a device would run it: FP32 passes cold self-tests on the
machine that built it, a broken INT8 or an injected fault is rejected with the metric that caught
it, the selected variant is the fastest one that keeps fidelity, and the agent's decoded results
agree with the package's own end-to-end results on held-out frames. Skipped when the cache lacks
the models or references (`scripts/test.sh` fetches them; offline runs skip).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent")) / "real-models"
SPECS = ROOT / "scripts" / "specs" / "real"
REPEATS = int(os.environ.get("EDGE_AGENT_REAL_REPEATS", "20"))  # cold FP32 self-tests per model (issue: 20 of 20)
MIN_AGREEMENT = 0.98
RESULTS = CACHE / "results.json"  # the measured figures, for the README and the report

_spec = importlib.util.spec_from_file_location("real_models", ROOT / "scripts" / "real_models.py")
real_models = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
sys.modules.setdefault("real_models", real_models)  # dataclasses look their module up while loading
_spec.loader.exec_module(real_models)
NAMES = [m.name for m in real_models.MODELS]
LABELS = {
    "orientation": ["0", "90", "180", "270"],
    "layout": ["Caption", "Footnote", "Formula", "List-item", "Page-footer", "Page-header", "Picture",
               "Section-header", "Table", "Text", "Title"],
}
# layout: 15, not 16: ORT merges MinMax ranges every 16 runs (CalibMaxIntermediateOutputs) and a set of
# exactly 16 batch-1 runs ends with "No data is collected" (reported to wip/spec).
CALIBRATION_LIMIT = {"orientation": 32, "textdet": 8, "layout": 15, "vad": 8}

# Features other branches are adding; a test that needs one is an expected failure only while it is
# missing here (the conditions read the shipped schema and CLI, so they flip by themselves on merge).
_SCHEMA = (ROOT / "agent" / "schema" / "bundle.schema.json").read_text()
_CLI = (ROOT / "agent" / "service" / "cli.py").read_text()


def _sensor_window_as_rank2() -> bool:
    """Silero's `input` is [B, 576]: the bundle's preprocessing must give a rank-2 tensor for a
    one-channel window (probed on the agent itself, so the mark flips when the feature lands)."""
    try:
        from agent.spec.manifest import FrameSpec, preprocess_from_dict
        from agent.spec.preprocess import Preprocessor

        s = yaml.safe_load((SPECS / "vad.yaml").read_text())
        pre = Preprocessor(preprocess_from_dict(s["preprocess"]), FrameSpec(**s["frame"]))
        return pre(np.zeros((576, 1), np.float32)).ndim == 2
    except Exception:
        return False


_SPEC_FEATURE = {
    "orientation": ("short_side_crop" in _SCHEMA and "lanczos" in _SCHEMA, "short_side_crop + lanczos"),
    "textdet": ("fit_multiple" in _SCHEMA and "segmentation" in _SCHEMA, "fit_multiple + segmentation decoder"),
    "layout": ("yolov8" in _SCHEMA, "the yolov8 detection layout"),
    "vad": ('"inputs"' in _SCHEMA and _sensor_window_as_rank2(),
            "constant/state inputs and a rank-2 [B, window] tensor for a one-channel sensor window"),
}
HAS_VERDICTS = "fidelity" in _SCHEMA or "floors" in _SCHEMA
HAS_DRIFT_CHECK = "allow-preprocess-drift" in _CLI


def needs_spec(name: str) -> pytest.MarkDecorator:
    ok, what = _SPEC_FEATURE[name]
    return pytest.mark.xfail(not ok, strict=False, reason=f"needs {what} from wip/spec")


needs_verdicts = pytest.mark.xfail(
    not HAS_VERDICTS, strict=False, reason="needs reproduction/fidelity verdicts and author floors from wip/verdicts")


def params(names: list[str] = NAMES, verdicts: bool = False) -> list[Any]:
    out = []
    for n in names:
        marks = [needs_spec(n)] + ([needs_verdicts] if verdicts else [])
        out.append(pytest.param(n, marks=marks, id=n))
    return out


def missing(name: str) -> str | None:
    d = CACHE / name
    model = d / "model.onnx"
    if not model.exists():
        return f"{model} is missing: run `python scripts/real_models.py fetch` (scripts/test.sh does)"
    if not (d / "references.json").exists():
        return f"{d}/references.json is missing: run `python scripts/real_models.py references`"
    return None


def require(name: str) -> Path:
    why = missing(name)
    if why:
        pytest.skip(why)
    return CACHE / name


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "agent", "--log-level", "warning", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def strict_json(text: str) -> Any:
    def refuse(const: str) -> Any:
        raise ValueError(f"non-standard JSON constant {const}")
    return json.loads(text, parse_constant=refuse)


def record(name: str, key: str, value: Any) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data.setdefault(name, {})[key] = value
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_BUILT: dict[str, Path] = {}
_BUILD_ERRORS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def fresh_results() -> None:
    """Figures from this run only (the cold-pass counter accumulates within a run)."""
    if RESULTS.parent.exists():
        RESULTS.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real")


def build(name: str, workdir: Path) -> Path:
    """`bundle create` from the package's references: FP32 and a whole-graph INT8 kept even when low."""
    if name in _BUILT:
        return _BUILT[name]
    if name in _BUILD_ERRORS:  # a failed build is not retried by each of the 20 cold self-tests
        pytest.fail(_BUILD_ERRORS[name])
    d = require(name)
    out = workdir / f"{name}-bundle"
    args = ["bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(SPECS / f"{name}.yaml"),
            "--calibration", str(d / "calibration.npz"), "--golden", str(d / "golden.npz"),
            "--heldout", str(d / "heldout.npz"), "--out", str(out), "--keep-low-quality",
            "--calibration-limit", str(CALIBRATION_LIMIT[name])]
    if name in LABELS:
        labels = workdir / f"{name}-labels.txt"
        labels.write_text("\n".join(LABELS[name]) + "\n")
        args += ["--labels", str(labels)]
    r = cli(*args)
    if r.returncode != 0:
        _BUILD_ERRORS[name] = f"bundle create {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        pytest.fail(_BUILD_ERRORS[name])
    _BUILT[name] = out
    return out


def selftest(bundle: Path, state: Path, *extra: str) -> dict[str, Any]:
    r = cli("selftest", "--bundle", str(bundle), "--state-dir", str(state), "--json", "--no-cache", *extra)
    assert r.returncode in (0, 3), f"selftest error rc={r.returncode}:\n{r.stderr[-3000:]}"
    return strict_json(r.stdout)  # the issue: `selftest --json` parses with a strict JSON parser


# ---------------------------------------------------------------------------------------------
# Build

@pytest.mark.parametrize("name", params())
def test_real_model_bundle_builds_from_package_references(name: str, workdir: Path) -> None:
    out = build(name, workdir)
    r = cli("bundle", "verify", str(out))
    assert r.returncode == 0, r.stderr
    manifest = yaml.safe_load((out / "bundle.yaml").read_text())
    variants = {v["name"]: v for v in manifest["variants"]}
    assert "fp32" in variants
    record(name, "variants", {k: {"precision": v["precision"], "quality": v.get("quality", {})} for k, v in variants.items()})


def test_fetched_models_match_their_pins_and_licences() -> None:
    for m in real_models.MODELS:
        if missing(m.name):
            pytest.skip(missing(m.name))
        info = json.loads((CACHE / m.name / "source.json").read_text())
        assert info["sha256"] == m.sha256 == real_models.sha256(CACHE / m.name / "model.onnx")
        assert info["licence"] == m.licence and info["package"] == m.package and info["version"] == m.version


# ---------------------------------------------------------------------------------------------
# Self-test verdicts

def _cold_params() -> list[Any]:
    out = []
    for n in NAMES:
        for i in range(REPEATS):
            out.append(pytest.param(n, i, marks=[needs_spec(n), needs_verdicts], id=f"{n}-{i:02d}"))
    return out


@pytest.mark.parametrize(("name", "attempt"), _cold_params())
def test_fp32_passes_cold_selftest_on_the_machine_that_built_it(name: str, attempt: int, workdir: Path) -> None:
    """Each attempt is a fresh process with no verdict cache: FP32 must pass every time (issue: 20 of 20)."""
    bundle = build(name, workdir)
    report = selftest(bundle, workdir / f"{name}-cold-{attempt}", "--variant", "fp32", "--latency-runs", "3")
    fp32 = [c for c in report["candidates"] if c["variant"] == "fp32" and c["status"] == "tested"]
    assert fp32 and fp32[0]["passed"], f"FP32 rejected on attempt {attempt}: {fp32[0]['reasons'] if fp32 else report}"
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    passes = data.get(name, {}).get("fp32_cold_passes", 0) + 1
    record(name, "fp32_cold_passes", passes)


_FULL: dict[str, dict[str, Any]] = {}


def full_report(name: str, workdir: Path) -> dict[str, Any]:
    """One unpinned self-test per model, as a device boots it (every variant a candidate)."""
    if name not in _FULL:
        _FULL[name] = selftest(build(name, workdir), workdir / f"{name}-full", "--latency-runs", "10")
    return _FULL[name]


_METRIC_REASON = re.compile(r"(recall|precision|iou|top1|agreement|snr|error|max_abs|allclose|cosine)\S* = \S+ (under|over)")


@pytest.mark.parametrize("name", params(verdicts=True))
def test_selected_variant_is_the_fastest_that_keeps_fidelity(name: str, workdir: Path) -> None:
    bundle = build(name, workdir)
    report = full_report(name, workdir)
    tested = [c for c in report["candidates"] if c["status"] == "tested"]
    summary = {c["variant"]: {"passed": c["passed"], "reasons": c["reasons"], "p50_ms": (c.get("latency") or {}).get("p50_ms"),
                              "parity": c.get("parity")} for c in tested}
    record(name, "selftest", {"selected": report["selected"] and report["selected"]["variant"], "candidates": summary})
    assert report["selected"] is not None, report["reason"]
    for c in tested:
        if not c["passed"]:
            assert c["reasons"] and all(r.strip() for r in c["reasons"]), f"{c['variant']} rejected without a reason"
            assert any(_METRIC_REASON.search(r) for r in c["reasons"]), f"{c['variant']}: reasons name no metric: {c['reasons']}"
    passed = [c for c in tested if c["passed"]]
    chosen = next(c for c in passed if c["variant"] == report["selected"]["variant"])
    fastest = min(c["latency"]["p50_ms"] for c in passed)
    assert chosen["latency"]["p50_ms"] <= fastest * 1.10 + 0.05, f"{chosen['variant']} chosen over a faster passing variant: {summary}"
    # The manifest's own record: a variant built under its floor is marked and never selected.
    manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
    low = [v["name"] for v in manifest["variants"] if v.get("quality", {}).get("below_quality_bound")]
    assert report["selected"]["variant"] not in low, (
        f"selected {report['selected']['variant']}, which the build marked under its quality bound: "
        f"{[v.get('quality', {}).get('below_quality_bound') for v in manifest['variants'] if v['name'] in low]}")


@pytest.mark.parametrize("name", ["layout", "textdet"])
def test_whole_graph_int8_of_a_real_head_is_rejected_for_fidelity(name: str, workdir: Path) -> None:
    """The issue's broken INT8s: YOLOv8 scores share a scale with box coordinates; DBNet maps collapse.
    Whatever the build measured, the self-test must not select them, and must say which task metric failed."""
    require(name)
    request_marks(name)
    bundle = build(name, workdir)
    report = full_report(name, workdir)
    int8 = [c for c in report["candidates"] if c["variant"] == "int8"]
    if not int8:
        pytest.skip(f"{name}: bundle create dropped the INT8 variant (refused at build): {report['reason']}")
    c = int8[0]
    record(name, "int8_verdict", {"status": c["status"], "passed": c["passed"], "reasons": c["reasons"], "parity": c.get("parity")})
    selected = report["selected"]["variant"] if report["selected"] else None
    if c["status"] == "tested" and c["passed"]:
        # Not broken on this build: then it must really keep fidelity, end to end against the package.
        agreement = end_to_end(name, bundle, "int8")
        record(name, "end_to_end_int8", agreement)
        assert agreement["agreement"] >= MIN_AGREEMENT, f"INT8 passed the self-test but agrees with the package on {agreement}"
        return
    assert selected != "int8", f"a rejected INT8 was selected: {report}"
    if c["status"] == "tested":
        assert any(re.search(r"(recall|precision|iou|snr|error)", r) for r in c["reasons"]), c["reasons"]
    else:  # never tried because the build marked it under its floor: the manifest says so
        manifest = yaml.safe_load((bundle / "bundle.yaml").read_text())
        v = next(v for v in manifest["variants"] if v["name"] == "int8")
        assert c["reasons"] or v.get("quality", {}).get("below_quality_bound"), (c, v)


def request_marks(name: str) -> None:
    ok, what = _SPEC_FEATURE[name]
    if not ok or not HAS_VERDICTS:
        pytest.xfail(f"needs {what} from wip/spec" if not ok else "needs fidelity verdicts from wip/verdicts")


@pytest.mark.parametrize("name", params())
def test_corrupted_fp32_weights_fail_reproduction(name: str, workdir: Path) -> None:
    """An injected fault: one weight tensor scaled by 1.5, the manifest re-hashed (as a bad copy or a
    wrong kernel would look to the device): the self-test rejects FP32 at stage model."""
    import onnx
    from onnx import numpy_helper

    bundle = build(name, workdir)
    bad = workdir / f"{name}-corrupt"
    if not bad.exists():
        import shutil
        shutil.copytree(bundle, bad)
        manifest = yaml.safe_load((bad / "bundle.yaml").read_text())
        fp32 = next(v for v in manifest["variants"] if v["name"] == "fp32")
        model = onnx.load(str(bad / fp32["file"]))
        big = max((i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT),
                  key=lambda i: int(np.prod(i.dims)))
        big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big) * np.float32(1.5), big.name))
        onnx.save(model, str(bad / fp32["file"]))
        manifest["files"][fp32["file"]] = real_models.sha256(bad / fp32["file"])
        (bad / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    report = selftest(bad, workdir / f"{name}-corrupt-state", "--variant", "fp32", "--latency-runs", "3")
    fp32c = [c for c in report["candidates"] if c["variant"] == "fp32" and c["status"] == "tested"]
    assert fp32c and not fp32c[0]["passed"], f"corrupted FP32 passed: {fp32c}"
    record(name, "corrupt_fp32_reasons", fp32c[0]["reasons"])
    assert any("model" in r for r in fp32c[0]["reasons"]), fp32c[0]["reasons"]


# ---------------------------------------------------------------------------------------------
# End to end: the agent's decoded results against the package's own results, held-out frames

def _iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _match(ours: list[list[float]], theirs: list[list[float]], ok: Any) -> int:
    """Greedy one-to-one matches between two box lists under the predicate ok(our_box, their_box)."""
    used: set[int] = set()
    n = 0
    for a in ours:
        for j, b in enumerate(theirs):
            if j not in used and ok(a, b):
                used.add(j)
                n += 1
                break
    return n


def end_to_end(name: str, bundle: Path, variant: str) -> dict[str, Any]:
    """Serve every held-out frame through the agent's engine (preprocess, session, decoder) and compare
    the published result with the package's own end-to-end result for that frame."""
    from agent.bundle.load import load_bundle
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine
    from agent.spec.decoders import decode

    b = load_bundle(bundle)
    precision = b.manifest.variant(variant).precision
    engine = build_engine(b, Candidate(CPU, variant, precision), SessionSettings(intra_op_threads=2))
    d = CACHE / name
    theirs = json.loads((d / "heldout.package.json").read_text())
    with np.load(d / "heldout.npz", allow_pickle=False) as z:
        raw = z["raw"]
    run = getattr(engine, "run", None) or (lambda t, source="": engine.opened.run(t))
    agree, details = 0, {}
    if name == "vad":
        same = total = 0
        worst = 0.0
        for i, seq in enumerate(raw):
            if hasattr(engine, "reset_source"):
                engine.reset_source(f"seq{i}")
            for t, window in enumerate(seq):
                outs = run(engine.preprocessor(window), source=f"seq{i}")
                p = float(np.asarray(outs["output"]).reshape(-1)[0])
                q = theirs[i]["probabilities"][t]
                worst = max(worst, abs(p - q))
                same += (p >= 0.5) == (q >= 0.5)
                total += 1
        return {"agreement": same / total, "frames": total, "max_abs_probability": worst,
                "speech_fraction": float(np.mean([s for r in theirs for s in r["speech"]]))}
    box_totals = {"ours": 0, "theirs": 0, "matched": 0}
    for i, frame in enumerate(raw):
        tensor = engine.preprocessor(frame)
        outs = run(tensor)
        result = decode(b.manifest.postprocess, outs, engine.labels, engine.preprocessor.geometry(frame))
        if name == "orientation":
            ok = result["top"][0]["class_id"] == theirs[i]["class_id"]
        elif name == "layout":
            ours = [(d_["box"], d_["class_id"]) for d_ in result["detections"]]
            pkg = [(d_["box"], d_["class_id"]) for d_ in theirs[i]["detections"]]
            m = _match(ours, pkg, lambda a, c: a[1] == c[1] and _iou(a[0], c[0]) >= 0.5)
            ok = m == len(ours) == len(pkg)
            box_totals["ours"] += len(ours); box_totals["theirs"] += len(pkg); box_totals["matched"] += m
        else:  # textdet: package quads -> their bounding boxes; our regions are map components in frame pixels
            pkg = [[min(p[0] for p in q), min(p[1] for p in q), max(p[0] for p in q), max(p[1] for p in q)]
                   for q in theirs[i]["quads"]]
            ours = [r["box"] for r in result["regions"]]
            m = _match(ours, pkg, lambda a, c: _iou(a, c) >= 0.5)
            ok = m == len(ours) == len(pkg)
            box_totals["ours"] += len(ours); box_totals["theirs"] += len(pkg); box_totals["matched"] += m
        agree += bool(ok)
    details = {"agreement": agree / len(raw), "frames": int(len(raw))}
    if box_totals["theirs"]:
        details.update(recall=box_totals["matched"] / max(box_totals["theirs"], 1),
                       precision=box_totals["matched"] / max(box_totals["ours"], 1), boxes=box_totals["theirs"])
    return details


@pytest.mark.parametrize("name", params())
def test_agent_results_agree_with_the_package_end_to_end(name: str, workdir: Path) -> None:
    bundle = build(name, workdir)
    got = end_to_end(name, bundle, "fp32")
    record(name, "end_to_end_fp32", got)
    print(f"\n{name}: FP32 end-to-end agreement with the package {got}")
    assert not math.isnan(got["agreement"])
    assert got["agreement"] >= MIN_AGREEMENT, f"{name}: agent agrees with the package on {got}"


@pytest.mark.xfail(not HAS_DRIFT_CHECK, strict=False, reason="needs the preprocessing-drift check from wip/spec")
def test_spec_that_cannot_reproduce_the_package_preprocessing_is_refused_with_numbers(workdir: Path) -> None:
    """Issue 11: stretching to 224 instead of the package's short-side resize + centre crop."""
    d = require("orientation")
    spec = yaml.safe_load((SPECS / "orientation.yaml").read_text())
    spec["preprocess"]["resize"] = {"mode": "stretch", "width": 224, "height": 224, "interpolation": "linear"}
    wrong = workdir / "orientation-stretch.yaml"
    wrong.write_text(yaml.safe_dump(spec))
    r = cli("bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(wrong),
            "--calibration", str(d / "golden.npz"), "--golden", str(d / "golden.npz"), "--no-int8",
            "--out", str(workdir / "orientation-stretch"))
    assert r.returncode != 0
    assert re.search(r"max.abs", r.stderr) and re.search(r"sample", r.stderr), r.stderr[-2000:]
    assert not (workdir / "orientation-stretch").exists()
