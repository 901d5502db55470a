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
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent")) / "real-models"
SPECS = ROOT / "scripts" / "specs" / "real"
# Cold FP32 self-tests per model: 3 on every run; the 20-of-20 statistic with EDGE_AGENT_REAL_REPEATS=20.
REPEATS = int(os.environ.get("EDGE_AGENT_REAL_REPEATS", "3"))
MIN_AGREEMENT = 0.98
# The measured figures of this run, for the README and the report: written in this run's own folder
# (other checkouts may run this file at the same time) and copied to CACHE/results.json at the end.
RESULTS_COPY = CACHE / "results.json"
RESULTS = RESULTS_COPY  # set per run by the `results` fixture

_spec = importlib.util.spec_from_file_location("real_models", ROOT / "scripts" / "real_models.py")
real_models = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
sys.modules.setdefault("real_models", real_models)  # dataclasses look their module up while loading
_spec.loader.exec_module(real_models)
# Models whose bundles carry pre/post stage graphs and package answers have their own files
# (tests/e2e/test_real_detectors.py, tests/e2e/test_real_staged.py, tests/e2e/test_real_keypoints.py, tests/e2e/test_real_masks.py);
# this file's machinery is the vocabulary's (npz sets, decoders).
# models with their own files: staged (pre/post graphs) and the time-major recogniser (tests/e2e/test_real_timemajor.py)
STAGED = {"picodet", "textrec", "textcls", "retinaface", "u2netp", "ddddocr"}
NAMES = [m.name for m in real_models.MODELS if m.name not in STAGED]
LABELS = {
    "orientation": ["0", "90", "180", "270"],
    "layout": ["Caption", "Footnote", "Formula", "List-item", "Page-footer", "Page-header", "Picture",
               "Section-header", "Table", "Text", "Title"],
}
# Frames per calibration run set: small, so the file fits CI; each is a whole model run at full size.
CALIBRATION_LIMIT = {"orientation": 32, "textdet": 8, "layout": 16, "vad": 8}
# Silero VAD's Conv and LSTM nodes sit inside If branches that ORT's quantizer does not enter: its INT8
# quantizes nothing, so `bundle create` refuses it and the bundle is FP32 only.
NO_INT8 = {"vad"}
# Held-out frames for the build's own quality figures where each frame is a large, slow model run.
BUILD_HELDOUT = {"textdet": 16, "layout": 16}
WITH_INT8 = [n for n in NAMES if n not in NO_INT8]
# The author's quantisation choices. DBNet's map loses boxes with 7-bit weights (the default, which answers
# the same on CPUs without VNNI): end to end on the 50 held-out frames, 7-bit agreed with the package on
# 0.96 of them (2 frames lost a box of 450; 16 calibration frames or the head kept in float, the same), 8-bit
# on 0.98 (both measured on AVX-512 VNNI). So this bundle is built with 8-bit weights, as before, for VNNI
# CPUs (its golden outputs are recorded on the machine that builds it, so the test's own device reproduces
# them either way; a device of another CPU kind would refuse an INT8 it answers differently).
# layout (boxes) and textdet (masks) carry their package's results beside the npz (<split>.package.json: boxes,
# and textdet's quads, which no result kind reads), judged by this file's tests, not as the build's answers: their
# decoders are built with --allow-unproven-decoder (issue 42: a decoder without answers is refused otherwise)
BUILD_ARGS = {"textdet": ["--full-range-weights", "--allow-unproven-decoder"], "layout": ["--allow-unproven-decoder"]}
pytestmark = [pytest.mark.slow, pytest.mark.real]  # whole real models, built and proven: with -n 2, a file per worker (budgets have 10x headroom; variants are timed interleaved)


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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="module", autouse=True)
def results(workdir: Path) -> Any:
    """Figures from this run only, in its own folder; copied (atomically) into the cache at the end."""
    global RESULTS
    RESULTS = workdir / "results.json"
    yield RESULTS
    if RESULTS.exists() and RESULTS_COPY.parent.exists():
        tmp = RESULTS_COPY.with_suffix(f".{os.getpid()}.part")
        tmp.write_text(RESULTS.read_text())
        tmp.replace(RESULTS_COPY)
        print(f"\nreal-model figures: {RESULTS_COPY}")


# Built bundles, cached by the hash of everything a build reads: the command line, the model, spec and
# sample sets, the agent's build code and the onnxruntime/onnx versions. A commit that changes none of
# them reuses the bundle (minutes per model on 2 cores); any change builds it again.
BUILT = CACHE.parent / "real-bundles"
BUILD_CODE = ("agent/bundle", "agent/vocabulary", "agent/proof", "agent/results", "agent/schema", "agent/testing.py")


def build_key(args: list[str], out: Path) -> str:
    """Everything a build reads: flags and values as text; files (model, spec, labels, stage graphs) and
    sample folders (frames, answers.json) by their bytes, not their paths; the agent's build code; the
    onnxruntime/onnx versions."""
    import hashlib

    import onnx
    import onnxruntime

    h = hashlib.sha256()
    h.update(" ".join(a for a in args if a != str(out) and not Path(a).exists()).encode())
    h.update(f"{onnxruntime.__version__} {onnx.__version__}".encode())
    files: list[Path] = []
    for a in args:
        p = Path(a)
        files += sorted(p.rglob("*")) if p.is_dir() else [p] if p.is_file() else []
    for rel in BUILD_CODE:
        p = ROOT / rel
        files += sorted(p.rglob("*")) if p.is_dir() else [p]
    for f in files:
        if f.is_file() and f.suffix != ".pyc":
            h.update(str(f.relative_to(ROOT)).encode() if f.is_relative_to(ROOT) else f.name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def keep_built(out: Path, cached: Path) -> None:
    """A fresh build into the cache (tests copy a bundle before they damage it: the cached one stays as
    built), by rename, so two runs never see half a bundle."""
    if not BUILT.parent.exists():
        return
    BUILT.mkdir(exist_ok=True)
    tmp = cached.with_name(cached.name + f".{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another run cached the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    # the same bundle built by older build code is never read again (its key named that code): without
    # this the cache grew by every real bundle (about 330 MB) each time agent/bundle, spec or proof changed
    stem = cached.name.rsplit("-", 1)[0]
    for old in BUILT.glob(f"{stem}-*"):
        if old != cached and old.is_dir() and old.name.rsplit("-", 1)[0] == stem and not old.name.endswith(".part"):
            shutil.rmtree(old, ignore_errors=True)


class Bundles:
    """Each model's bundle, built once per module by `bundle create` from the package's references:
    FP32 and a whole-graph INT8, kept (marked) even when under a floor so the self-test must refuse it.
    A failed build fails every test of that model once, with the build's own output."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.built: dict[str, Path] = {}
        self.errors: dict[str, str] = {}

    def __call__(self, name: str) -> Path:
        if name in self.built:
            return self.built[name]
        if name in self.errors:
            pytest.fail(self.errors[name])
        d = require(name)
        out = self.workdir / f"{name}-bundle"
        args = ["bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(SPECS / f"{name}.yaml"),
                "--calibration", str(d / "calibration.npz"), "--golden", str(d / "golden.npz"),
                "--heldout", str(self.heldout_for_build(name)), "--out", str(out), "--keep-low-quality",
                "--calibration-limit", str(CALIBRATION_LIMIT[name])] + (["--no-int8"] if name in NO_INT8 else []) \
            + BUILD_ARGS.get(name, [])
        if name in LABELS:
            labels = self.workdir / f"{name}-labels.txt"
            labels.write_text("\n".join(LABELS[name]) + "\n")
            args += ["--labels", str(labels)]
        cached = BUILT / f"{name}-{build_key(args, out)}"
        if (cached / "bundle.yaml").exists():
            self.built[name] = cached  # the same inputs and the same build code: the same bundle
            return cached
        r = cli(*args)
        if r.returncode != 0:
            self.errors[name] = f"bundle create {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
            pytest.fail(self.errors[name])
        keep_built(out, cached)
        self.built[name] = out
        return out


    def heldout_for_build(self, name: str) -> Path:
        """The build's own held-out check on the first BUILD_HELDOUT frames, without the package's input
        tensors (hundreds of MB at 1024x1024; the drift check already covers calibration and golden).
        The agreement with the package is measured on every held-out frame by the end-to-end tests."""
        src = CACHE / name / "heldout.npz"
        if name not in BUILD_HELDOUT:
            return src
        dst = self.workdir / f"{name}-heldout-build.npz"
        if not dst.exists():
            with np.load(src, allow_pickle=False) as z:
                np.savez(dst, **{k: z[k][: BUILD_HELDOUT[name]] for k in z.files if k != "input"})
        return dst


@pytest.fixture(scope="module")
def bundles(workdir: Path) -> Bundles:
    return Bundles(workdir)


def selftest(bundle: Path, state: Path, *extra: str) -> dict[str, Any]:
    r = cli("selftest", "--bundle", str(bundle), "--state-dir", str(state), "--json", "--no-cache", *extra)
    assert r.returncode in (0, 3), f"selftest error rc={r.returncode}:\n{r.stderr[-3000:]}"
    return strict_json(r.stdout)  # the issue: `selftest --json` parses with a strict JSON parser


def manifest_of(bundle: Path) -> dict[str, Any]:
    return yaml.safe_load((bundle / "bundle.yaml").read_text())


# ---------------------------------------------------------------------------------------------
# Build

@pytest.mark.parametrize("name", NAMES)
def test_real_model_bundle_builds_from_package_references(name: str, bundles: Bundles) -> None:
    out = bundles(name)
    r = cli("bundle", "verify", str(out))
    assert r.returncode == 0, r.stderr
    variants = {v["name"]: v for v in manifest_of(out)["variants"]}
    assert set(variants) == ({"fp32"} if name in NO_INT8 else {"fp32", "int8"})
    record(name, "variants", {k: {"precision": v["precision"], "quality": v.get("quality", {}),
                                  "below_floor": v.get("below_floor")} for k, v in variants.items()})


def test_fetched_models_match_their_pins_and_licences() -> None:
    for m in real_models.MODELS:
        if missing(m.name):
            pytest.skip(missing(m.name))
        info = json.loads((CACHE / m.name / "source.json").read_text())
        assert info["sha256"] == m.sha256 == real_models.sha256(CACHE / m.name / "model.onnx")
        assert info["licence"] == m.licence and info["package"] == m.package and info["version"] == m.version


# ---------------------------------------------------------------------------------------------
# Self-test verdicts

@pytest.mark.parametrize("name", NAMES)
def test_fp32_passes_cold_selftests_on_the_machine_that_built_it(name: str, bundles: Bundles, workdir: Path) -> None:
    """REPEATS cold self-tests of FP32, each a fresh process with a fresh state folder and no verdict
    cache: FP32 must pass every time (issue: 20 of 20)."""
    bundle = bundles(name)
    failures: list[str] = []
    for attempt in range(REPEATS):
        report = selftest(bundle, workdir / f"{name}-cold-{attempt}", "--variant", "fp32", "--latency-runs", "3")
        fp32 = [c for c in report["candidates"] if c["variant"] == "fp32" and c["status"] == "tested"]
        if not (fp32 and fp32[0]["passed"]):
            failures.append(f"attempt {attempt}: {fp32[0]['reasons'] if fp32 else report['reason']}")
    record(name, "fp32_cold", {"passed": REPEATS - len(failures), "of": REPEATS, "failures": failures})
    assert not failures, f"FP32 failed {len(failures)} of {REPEATS} cold self-tests: {failures}"


_FULL: dict[str, dict[str, Any]] = {}


def full_report(name: str, bundle: Path, workdir: Path) -> dict[str, Any]:
    """One unpinned self-test per model, as a device boots it (every variant not marked below a floor
    is a candidate)."""
    if name not in _FULL:
        _FULL[name] = selftest(bundle, workdir / f"{name}-full", "--latency-runs", "10")
    return _FULL[name]


_METRIC_REASON = re.compile(r"(recall|precision|iou|top-?1|agreement|snr|error|max_abs|allclose|cosine|abs_diff)\S*"
                            r".* = \S+ (under|over)", re.IGNORECASE)


def _summary(c: dict[str, Any]) -> dict[str, Any]:
    return {"passed": c["passed"], "status": c["status"], "reasons": c["reasons"], "warnings": c.get("warnings", []),
            "p50_ms": (c.get("latency") or {}).get("p50_ms"), "parity": c.get("parity")}


@pytest.mark.parametrize("name", NAMES)
def test_selected_variant_is_the_fastest_that_keeps_fidelity(name: str, bundles: Bundles, workdir: Path) -> None:
    bundle = bundles(name)
    report = full_report(name, bundle, workdir)
    tested = [c for c in report["candidates"] if c["status"] == "tested"]
    below = {v["name"]: v["below_floor"] for v in manifest_of(bundle)["variants"] if v.get("below_floor")}
    record(name, "selftest", {"selected": report["selected"] and report["selected"]["variant"],
                              "candidates": {c["variant"]: _summary(c) for c in tested}, "below_floor": below,
                              "notes": report["notes"]})
    assert report["selected"] is not None, report["reason"]
    for c in tested:
        if not c["passed"]:
            assert c["reasons"] and all(r.strip() for r in c["reasons"]), f"{c['variant']} rejected without a reason"
            assert any(_METRIC_REASON.search(r) for r in c["reasons"]), f"{c['variant']}: reasons name no metric: {c['reasons']}"
    passed = [c for c in tested if c["passed"]]
    chosen = next(c for c in passed if c["variant"] == report["selected"]["variant"])
    fastest = min(c["latency"]["p50_ms"] for c in passed)
    assert chosen["latency"]["p50_ms"] <= fastest * 1.10 + 0.05, (
        f"{chosen['variant']} chosen over a faster passing variant: {[_summary(c) for c in passed]}")
    # A variant the build marked under its floor is never a candidate, so never selected.
    assert report["selected"]["variant"] not in below, f"selected {report['selected']['variant']}, marked below_floor: {below}"
    assert not report["pinned_below_floor"]
    for n in below:
        assert not any(c["variant"] == n for c in report["candidates"]), f"{n} is below_floor but was a candidate"
        assert any(n in note and "fidelity floor" in note for note in report["notes"]), report["notes"]


def _int8_verdict(name: str, bundle: Path, workdir: Path) -> dict[str, Any]:
    """The whole-graph INT8 as the device sees it unpinned, and pinned (measured even when marked)."""
    report = full_report(name, bundle, workdir)
    v = next(v for v in manifest_of(bundle)["variants"] if v["name"] == "int8")
    unpinned = [c for c in report["candidates"] if c["variant"] == "int8" and c["status"] == "tested"]
    pinned = selftest(bundle, workdir / f"{name}-pinned-int8", "--variant", "int8", "--latency-runs", "10")
    p = next(c for c in pinned["candidates"] if c["variant"] == "int8" and c["status"] == "tested")
    verdict = {"below_floor": v.get("below_floor"), "unpinned": _summary(unpinned[0]) if unpinned else None,
               "pinned": _summary(p), "pinned_below_floor": pinned["pinned_below_floor"],
               "selected": report["selected"] and report["selected"]["variant"]}
    record(name, "int8_verdict", verdict)
    return verdict


def test_whole_graph_int8_of_yolov8_is_marked_below_floor_for_recall_and_never_selected(bundles: Bundles, workdir: Path) -> None:
    """The issue's broken INT8: the YOLOv8 head's last Concat puts box coordinates (0..1024) and class
    scores (0..1) under one uint8 scale, so no score reaches the threshold (output cosine still 0.999).
    The build marks it below_floor naming recall; unpinned it is no candidate; pinned (the config's
    explicit choice) it serves, with the failed fidelity as a warning in the report."""
    bundle = bundles("layout")
    v = _int8_verdict("layout", bundle, workdir)
    assert v["selected"] == "fp32"
    assert v["below_floor"] and re.search(r"fidelity: recall = \S+ under bound 0\.9 on sample \d+ at stage build",
                                           v["below_floor"]), v["below_floor"]
    assert v["unpinned"] is None, "a below_floor variant was a candidate"
    assert v["pinned_below_floor"], "a pinned below_floor variant must be loud in the report"
    assert v["pinned"]["parity"]["fidelity_passed"] is False, v["pinned"]
    assert any(re.search(r"recall = \S+ under", str(w)) for w in v["pinned"]["warnings"]), v["pinned"]


@pytest.mark.parametrize("name", WITH_INT8)
def test_int8_is_selected_only_when_it_keeps_fidelity_end_to_end(name: str, bundles: Bundles, workdir: Path) -> None:
    """Whatever the build measured, an INT8 the self-test passes must agree with the package's own
    end-to-end results as FP32 does; one it refuses (or the build marked) is never selected."""
    bundle = bundles(name)
    v = _int8_verdict(name, bundle, workdir)
    if v["unpinned"] and v["unpinned"]["passed"]:
        got = end_to_end(name, bundle, "int8", workdir)
        record(name, "end_to_end_int8", got)
        assert got["agreement"] >= MIN_AGREEMENT, f"{name}: INT8 passed the self-test but agrees with the package on {got}"
    else:
        assert v["selected"] != "int8", v
        reasons = v["unpinned"]["reasons"] if v["unpinned"] else [v["below_floor"]]
        assert any(_METRIC_REASON.search(r or "") for r in reasons), reasons


def test_an_int8_whose_map_range_collapsed_is_refused_for_mask_iou(bundles: Bundles, workdir: Path) -> None:
    """An injected fault of the kind the issue saw on DBNet (all-zero maps): the INT8's output range
    calibrated as if on blank pages (0..0.25, under the 0.3 threshold), the manifest re-hashed. The
    self-test refuses it on fidelity (mask IoU against the package's references) and on reproduction."""
    import shutil

    import onnx
    from onnx import numpy_helper

    bundle = bundles("textdet")
    bad = workdir / "textdet-int8-collapsed"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(bundle, bad)
    manifest = manifest_of(bad)
    int8 = next(v for v in manifest["variants"] if v["name"] == "int8")
    model = onnx.load(str(bad / int8["file"]))
    out = manifest["postprocess"]["output"]
    dq = next(n for n in model.graph.node if out in n.output and n.op_type == "DequantizeLinear")
    scale = next(i for i in model.graph.initializer if i.name == dq.input[1])
    scale.CopyFrom(numpy_helper.from_array(np.asarray(0.25 / 255, np.float32).reshape(numpy_helper.to_array(scale).shape), scale.name))
    onnx.save(model, str(bad / int8["file"]))
    manifest["files"][int8["file"]] = real_models.sha256(bad / int8["file"])
    (bad / "bundle.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    report = selftest(bad, workdir / "textdet-int8-collapsed-state", "--latency-runs", "3")
    c = next(c for c in report["candidates"] if c["variant"] == "int8" and c["status"] == "tested")
    record("textdet", "collapsed_int8_reasons", c["reasons"])
    assert not c["passed"] and report["selected"]["variant"] == "fp32", _summary(c)
    assert any(re.search(r"fidelity: mask IoU = \S+ under bound", r) for r in c["reasons"]), c["reasons"]
    assert any(r.startswith("reproduction") for r in c["reasons"]), c["reasons"]


def test_vad_int8_that_quantizes_nothing_is_refused_by_bundle_create(workdir: Path) -> None:
    d = require("vad")
    out = workdir / "vad-int8"
    r = cli("bundle", "create", "--model", str(d / "model.onnx"), "--spec", str(SPECS / "vad.yaml"),
            "--calibration", str(d / "calibration.npz"), "--golden", str(d / "golden.npz"), "--out", str(out),
            "--calibration-limit", "2")
    assert r.returncode != 0 and not out.exists()
    assert "INT8 quantization quantized no node" in r.stderr and "--no-int8" in r.stderr, r.stderr[-2000:]
    record("vad", "int8_refused", r.stderr.strip().splitlines()[-1])


def _corrupt_largest_weights(model: Any) -> list[str]:
    """Scale by 1.5 the largest float weight of the graph and of each subgraph (If branches), whether
    it is an initializer or a Constant node's value (PaddlePaddle and Silero exports use Constants)."""
    import onnx
    from onnx import numpy_helper

    def tensors(graph: Any) -> list[Any]:
        found = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        found += [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute
                  if a.name == "value" and a.t.data_type == onnx.TensorProto.FLOAT]
        return found

    def graphs(graph: Any) -> list[Any]:
        out = [graph]
        for n in graph.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    out += graphs(a.g)
        return out

    changed = []
    for g in graphs(model.graph):
        ts = tensors(g)
        if not ts:
            continue
        big = max(ts, key=lambda t: int(np.prod(t.dims)))
        if int(np.prod(big.dims)) < 64:
            continue
        big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big) * np.float32(1.5), big.name))
        changed.append(f"{g.name}/{big.name} {list(big.dims)}")
    return changed


@pytest.mark.parametrize("name", NAMES)
def test_corrupted_fp32_weights_fail_reproduction(name: str, bundles: Bundles, workdir: Path) -> None:
    """An injected fault: the largest weight scaled by 1.5, the manifest re-hashed (as a bad copy or a
    wrong kernel would look to the device): the self-test rejects FP32 at stage model."""
    import shutil

    import onnx

    bundle = bundles(name)
    bad = workdir / f"{name}-corrupt"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(bundle, bad)
    manifest = manifest_of(bad)
    fp32 = next(v for v in manifest["variants"] if v["name"] == "fp32")
    model = onnx.load(str(bad / fp32["file"]))
    assert _corrupt_largest_weights(model), f"{name}: no float weight found to corrupt"
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


def _match(ours: list[Any], theirs: list[Any], ok: Any) -> int:
    """Greedy one-to-one matches between two box lists under the predicate ok(ours_i, theirs_j)."""
    used: set[int] = set()
    n = 0
    for a in ours:
        for j, b in enumerate(theirs):
            if j not in used and ok(a, b):
                used.add(j)
                n += 1
                break
    return n


def _engine(bundle: Path, variant: str) -> Any:
    from agent.bundle.load import load_bundle
    from agent.proof.terms import CPU, SessionSettings
    from agent.proof.verdict import Candidate
    from agent.serving.engine import build_engine

    b = load_bundle(bundle)
    return build_engine(b, Candidate(CPU, variant, b.manifest.variant(variant).precision), SessionSettings(intra_op_threads=2))


def vad_served_from_a_file_source(bundle: Path, variant: str, workdir: Path) -> dict[str, Any]:
    """Each held-out recording as a 16 kHz float32 stream in a file, served by the agent's own sensor
    source (windows of 576 samples every 512), pipeline and engine; the published per-window speech
    probability against the package's own (OnnxWrapper) for the same window."""
    import time

    from agent.config import PipelineConfig, SourceConfig
    from agent.serving.pipeline import Pipeline
    from agent.serving.sources import is_lossless, open_source
    from agent.testing import ListSink

    engine = _engine(bundle, variant)
    theirs = json.loads((CACHE / "vad" / "heldout.package.json").read_text())
    with np.load(CACHE / "vad" / "heldout.npz", allow_pickle=False) as z:
        windows = z["raw"]  # (sequences, T, 576, 1): window t = the stream's samples [512 t, 512 t + 576)
    hop = 512
    same = total = 0
    worst = 0.0
    for i, seq in enumerate(windows):
        stream = np.concatenate([seq[0][:, 0]] + [w[-hop:, 0] for w in seq[1:]])
        path = workdir / f"vad-stream-{i}.f32"
        path.write_bytes(stream.astype("<f4").tobytes())
        cfg = SourceConfig(type="file", path=path, hop=hop)
        source = open_source(cfg, engine.bundle.manifest.frame)
        sink = ListSink()
        p = Pipeline(source, engine, sink, PipelineConfig(inference_workers=1, max_batch=1), is_lossless(cfg, source)).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not p.done.is_set():
            time.sleep(0.01)
        p.stop()
        assert p.join(timeout=15)
        source.close()
        probs = [float(r["result"]["outputs"]["output"]["values"][0]) for r in sink.results]
        want = theirs[i]["probabilities"]
        assert len(probs) == len(want), f"sequence {i}: {len(probs)} windows served, the package scored {len(want)}"
        for got, ref in zip(probs, want):
            worst = max(worst, abs(got - ref))
            same += (got >= 0.5) == (ref >= 0.5)
            total += 1
    return {"agreement": same / total, "frames": total, "sequences": int(len(windows)),
            "max_abs_probability": worst, "speech_fraction": float(np.mean([s for r in theirs for s in r["speech"]]))}


def end_to_end(name: str, bundle: Path, variant: str, workdir: Path) -> dict[str, Any]:
    """Serve every held-out frame through the agent's engine (preprocess, session, decoder) and compare
    the published result with the package's own end-to-end result for that frame."""
    from agent.vocabulary.decoders import decode

    if name == "vad":
        return vad_served_from_a_file_source(bundle, variant, workdir)
    engine = _engine(bundle, variant)
    theirs = json.loads((CACHE / name / "heldout.package.json").read_text())
    with np.load(CACHE / name / "heldout.npz", allow_pickle=False) as z:
        raw = z["raw"]
    agree = 0
    box_totals = {"ours": 0, "theirs": 0, "matched": 0}
    for i, frame in enumerate(raw):
        tensor, geometry = engine.preprocessor.with_geometry(frame)
        result = decode(engine.bundle.manifest.postprocess, engine.run(tensor), engine.labels, geometry)
        if name == "orientation":
            ok = result["top"][0]["class_id"] == theirs[i]["class_id"]
        else:
            if name == "layout":
                ours = [(d_["box"], d_["class_id"]) for d_ in result["detections"]]
                pkg = [(d_["box"], d_["class_id"]) for d_ in theirs[i]["detections"]]
                m = _match(ours, pkg, lambda a, c: a[1] == c[1] and _iou(a[0], c[0]) >= 0.5)
            else:  # textdet: the package's quads -> their bounding boxes; our regions in frame pixels
                pkg = [[min(p[0] for p in q), min(p[1] for p in q), max(p[0] for p in q), max(p[1] for p in q)]
                       for q in theirs[i]["quads"]]
                ours = [r["box"] for r in result["regions"]]
                m = _match(ours, pkg, lambda a, c: _iou(a, c) >= 0.5)
            ok = m == len(ours) == len(pkg)
            box_totals["ours"] += len(ours)
            box_totals["theirs"] += len(pkg)
            box_totals["matched"] += m
        agree += bool(ok)
    details: dict[str, Any] = {"agreement": agree / len(raw), "frames": int(len(raw))}
    if box_totals["theirs"]:
        details.update(recall=box_totals["matched"] / max(box_totals["theirs"], 1),
                       precision=box_totals["matched"] / max(box_totals["ours"], 1), boxes=box_totals["theirs"])
    return details


@pytest.mark.parametrize("name", NAMES)
def test_agent_results_agree_with_the_package_end_to_end(name: str, bundles: Bundles, workdir: Path) -> None:
    got = end_to_end(name, bundles(name), "fp32", workdir)
    record(name, "end_to_end_fp32", got)
    print(f"\n{name}: FP32 end-to-end agreement with the package {got}")
    assert not math.isnan(got["agreement"])
    assert got["agreement"] >= MIN_AGREEMENT, f"{name}: agent agrees with the package on {got}"


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
