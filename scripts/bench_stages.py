"""Stage graphs in their own sessions (as served) vs one session of the model merged with them by
`onnx.compose.merge_models` (issue 21, item 1: "merged into the variant where that measures faster").

    PYTHONPATH=$PWD python scripts/bench_stages.py [--rounds 7] [--frames 48] [--bundle DIR ...]

Bundles: the demo classifier built with equivalent pre/post graphs (tests/stage_graphs.py, as the
`demo_graph_bundle` fixture of tests/proof/test_stages.py), rapidocr's PP-OCR direction classifier and text
recogniser with the graphs of tests/e2e/test_real_staged.py (built here where the real-model cache holds them),
plus every staged bundle in
~/.cache/edge-agent/real-bundles (the real RetinaFace one built by tests/e2e/test_real_detectors.py) and any
--bundle given. Per bundle, on its golden frames, FP32 variant, CPU provider, the serving SessionSettings:

- separate: pre session -> model session -> post session, as the pipeline runs them (GraphPreprocessor
  .with_geometry, Engine.run, GraphPostprocessor.tensors; the result kind's compact step is the same in both
  paths and left out);
- merged: one session of pre + model + post (pre outputs -> model inputs, model outputs -> post inputs, the
  pre graph's `geometry` -> the post graph's and kept as an output, `frame_size` an input fed from the frame).

Rounds alternate (separate, merged, separate, ...) so load drifts hit both; per round the median wall and
thread-CPU time per frame; the table gives the median over rounds and the ratio per round. Then the merged
outputs are compared with the separate path's on every golden frame (exact, or the largest difference).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import compose, version_converter

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from agent.bundle.load import Bundle, load_bundle  # noqa: E402
from agent.proof.session import open_session  # noqa: E402
from agent.proof.stages import GraphPostprocessor, GraphPreprocessor, geometry_of, geometry_values  # noqa: E402
from agent.proof.terms import CPU, SessionSettings  # noqa: E402
from agent.proof.verdict import Candidate  # noqa: E402
from agent.serving.engine import Engine, build_engine  # noqa: E402
from agent.vocabulary.manifest import FRAME_SIZE, GEOMETRY, PRE_GRAPH_INPUT  # noqa: E402

DEMO = ROOT / "models" / "digits-classifier"
DEMO_FRAMES = ROOT / "models" / "demo-frames" / "digits"
REAL_BUNDLES = Path.home() / ".cache" / "edge-agent" / "real-bundles"
REAL_MODELS = Path.home() / ".cache" / "edge-agent" / "real-models"
FP32 = Candidate(CPU, "fp32", "fp32")
PRE, POST = "pre/", "post/"  # prefixes keep the three graphs' internal names apart


def demo_graph_bundle(d: Path) -> Path:
    """The demo classifier through equivalent graphs, as tests/proof/test_stages.py's fixture builds it."""
    from stage_graphs import demo_graph_bundle as build

    return build(d)


def ppocr_bundles(d: Path) -> list[Path]:
    """rapidocr's PP-OCR direction classifier (kind scores) and text recogniser (kind text) with the stage
    graphs of tests/e2e/test_real_staged.py, FP32 only, where the real-model cache holds them (`scripts/real_models.py
    fetch textcls textrec`); a few seconds each."""
    import importlib.util

    from agent.bundle.create import CreateOptions, create_bundle
    from agent.bundle.graphs import build_graph

    spec = importlib.util.spec_from_file_location("ppocr_rec_graphs", ROOT / "scripts" / "ppocr_rec_graphs.py")
    assert spec is not None and spec.loader is not None
    graphs = sys.modules["ppocr_rec_graphs"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graphs)
    made = []
    for name in ("textcls", "textrec"):
        src = REAL_MODELS / name
        if not (src / "model.onnx").is_file() or not (src / "golden").is_dir():
            continue
        if name == "textcls":
            pre, post = graphs.pre_graph(fixed_width=graphs.CLS_WIDTH), graphs.cls_post_graph()
        else:
            pre, post = graphs.pre_graph(), build_graph("post.ctc", {"input": graphs.MODEL_OUTPUT})
        onnx.save(pre, str(d / f"{name}-pre.onnx"))
        onnx.save(post, str(d / f"{name}-post.onnx"))
        extra: dict[str, Any] = {"charset": src / "charset.txt"} if name == "textrec" else {}
        if name == "textcls":
            (d / "textcls-labels.txt").write_text("180\n")
            extra["labels"] = d / "textcls-labels.txt"
        made.append(create_bundle(CreateOptions(
            model=src / "model.onnx", spec=ROOT / "scripts" / "specs" / "real" / f"{name}.yaml",
            calibration=src / "calibration", golden=src / "golden", out=d / f"{name}-bundle", int8=False,
            pre_graph=d / f"{name}-pre.onnx", post_graph=d / f"{name}-post.onnx", **extra)))
    return made


def _opset(m: onnx.ModelProto) -> int:
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


def merged_model(bundle: Bundle) -> tuple[onnx.ModelProto, list[str]]:
    """pre + FP32 model + post as one graph; returns it and its output names (post's, the model's, geometry)."""
    man = bundle.manifest
    if man.preprocess.graph is None or man.postprocess.graph is None or man.inputs or man.stateful:
        raise ValueError("merged here: a bundle with both stage graphs and one model input, no state")
    pre = onnx.load(str(bundle.path(man.preprocess.graph)))
    model = onnx.load(str(bundle.path(man.variant("fp32").file)))
    post = onnx.load(str(bundle.path(man.postprocess.graph)))
    target = max(_opset(g) for g in (pre, model, post))
    parts = []
    for g in (pre, model, post):  # merge_models needs one opset and one IR version
        if _opset(g) != target:
            g = version_converter.convert_version(g, target)
        parts.append(g)
    ir = max(g.ir_version for g in parts)
    for g in parts:
        g.ir_version = ir
    pre, model, post = parts
    pre_out = {o.name for o in pre.graph.output}
    model_out = [o.name for o in model.graph.output]
    pre_model = compose.merge_models(
        pre, model, io_map=[(n, n) for n in (i.name for i in model.graph.input) if n in pre_out],
        prefix1=PRE, outputs=[*model_out, *([PRE + GEOMETRY] if GEOMETRY in pre_out else [])])
    post_in = [i.name for i in post.graph.input]
    io_map = [(n, n) for n in post_in if n in model_out]  # merge_models prefixes the second side itself
    if GEOMETRY in post_in and GEOMETRY in pre_out:
        io_map.append((PRE + GEOMETRY, GEOMETRY))
    outs = [*model_out, *([PRE + GEOMETRY] if GEOMETRY in pre_out else []), *(POST + o.name for o in post.graph.output)]
    merged = compose.merge_models(pre_model, post, io_map=io_map, prefix2=POST, outputs=outs)
    onnx.checker.check_model(merged)
    return merged, outs


@dataclass
class Paths:
    engine: Engine
    pre: GraphPreprocessor
    post: GraphPostprocessor
    merged: ort.InferenceSession
    merged_outputs: list[str]
    feed_inputs: list[str]

    def separate(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        tensor, geometry = self.pre.with_geometry(raw)
        outs = self.engine.run(tensor)
        one = {k: v[0] for k, v in outs.items()}  # the publish stage takes one sample's outputs
        post = self.post.tensors(one, geometry)
        return {**outs, **{POST + k: v for k, v in post.items()}, PRE + GEOMETRY: geometry_values(geometry)}

    def merged_run(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """What a merged engine would have to do per frame too: the frame's check, the geometry's."""
        self.pre.check(raw)
        feeds: dict[str, np.ndarray] = {PRE + PRE_GRAPH_INPUT: np.ascontiguousarray(raw)}
        if POST + FRAME_SIZE in self.feed_inputs:
            feeds[POST + FRAME_SIZE] = np.array(raw.shape[:2], dtype=np.int64)
        if POST + GEOMETRY in self.feed_inputs:  # a pre graph with no geometry output: identity
            feeds[POST + GEOMETRY] = np.array([1, 1, 0, 0, 0, 0], np.float32)
        outs = dict(zip(self.merged_outputs, self.merged.run(self.merged_outputs, feeds)))
        if PRE + GEOMETRY in outs:
            geometry_of(outs[PRE + GEOMETRY], raw.shape[0], raw.shape[1])
        return outs

    def pipelined(self, frames: list[np.ndarray], merged: bool) -> tuple[float, float]:
        """The pipeline's shape of work: separate = pre, model and post in three threads joined by queues (the
        preprocessing worker, the inference worker, the publish stage); merged = the one session in the
        inference worker. Returns (wall ms, process CPU ms) per frame over all frames."""
        c0, w0 = time.process_time(), time.perf_counter()
        if merged:
            for raw in frames:
                self.merged_run(raw)
        else:
            q1: queue.Queue[Any] = queue.Queue(4)
            q2: queue.Queue[Any] = queue.Queue(4)

            def pre() -> None:
                for raw in frames:
                    q1.put(self.pre.with_geometry(raw))
                q1.put(None)

            def model() -> None:
                while (item := q1.get()) is not None:
                    tensor, geometry = item
                    q2.put((self.engine.run(tensor), geometry))
                q2.put(None)

            threads = [threading.Thread(target=pre), threading.Thread(target=model)]
            for t in threads:
                t.start()
            while (item := q2.get()) is not None:
                outs, geometry = item
                self.post.tensors({k: v[0] for k, v in outs.items()}, geometry)
            for t in threads:
                t.join()
        return ((time.perf_counter() - w0) * 1000 / len(frames), (time.process_time() - c0) * 1000 / len(frames))


def open_paths(bundle: Bundle, settings: SessionSettings, workdir: Path) -> Paths:
    engine = build_engine(bundle, FP32, settings)
    assert isinstance(engine.preprocessor, GraphPreprocessor) and isinstance(engine.postprocessor, GraphPostprocessor)
    model, outs = merged_model(bundle)
    path = workdir / f"{bundle.manifest.name}-merged.onnx"
    onnx.save(model, str(path))
    opened = open_session(path, CPU, None, settings)  # the serving session's options, as the variant's
    # the post graph's outputs that serving fetches, plus every model output (the non-finite check, the tap)
    wanted = [o for o in outs if not o.startswith(POST)] + [POST + n for n in engine.postprocessor.output_names]
    return Paths(engine, engine.preprocessor, engine.postprocessor, opened.session, wanted,
                 [i.name for i in opened.session.get_inputs()])


def time_path(fn: Callable[[np.ndarray], Any], frames: list[np.ndarray], n: int) -> tuple[float, float]:
    """Median wall and thread-CPU ms per frame over n frames (cycling the frames)."""
    walls, cpus = [], []
    for i in range(n):
        raw = frames[i % len(frames)]
        c0, w0 = time.thread_time(), time.perf_counter()
        fn(raw)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
    return statistics.median(walls) * 1000, statistics.median(cpus) * 1000


def compare(p: Paths, frames: list[np.ndarray]) -> str:
    """Merged against separate on every frame: bit-exact, or each differing output's largest difference."""
    worst: dict[str, float] = {}
    for raw in frames:
        a, b = p.separate(raw), p.merged_run(raw)
        for k in p.merged_outputs:
            x, y = np.asarray(a[k]), np.asarray(b[k])
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"DIFFERENT {k}: {x.shape} {x.dtype} vs {y.shape} {y.dtype}"
            if not np.array_equal(x, y):
                d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                worst[k] = max(worst.get(k, 0.0), d)
    if not worst:
        return f"bit-exact on {len(frames)} frames ({len(p.merged_outputs)} outputs)"
    return (f"NOT bit-exact over {len(frames)} frames (float rounding), max |diff|: "
            + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())))


def staged_bundles(extra: list[Path], workdir: Path) -> list[Path]:
    found = [demo_graph_bundle(Path(tempfile.mkdtemp(dir=workdir)))]
    found += ppocr_bundles(Path(tempfile.mkdtemp(dir=workdir)))
    if REAL_BUNDLES.is_dir():
        found += sorted(p for p in REAL_BUNDLES.iterdir() if (p / "bundle.yaml").is_file())
    return found + extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per path")
    ap.add_argument("--frames", type=int, default=0, help="frames timed per round (0: 48 for small models, 12 else)")
    ap.add_argument("--bundle", type=Path, action="append", default=[], help="another staged bundle directory")
    args = ap.parse_args()
    settings = SessionSettings()  # serving's defaults: 1 intra-op thread, no spinning, optimisation "all"
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, cores {len(os.sched_getaffinity(0))}, "
          f"settings {settings} (defaults), provider {CPU}, rounds {args.rounds}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = []
        for root in staged_bundles(args.bundle, work):
            bundle = load_bundle(root)
            m = bundle.manifest
            if m.preprocess.graph is None or m.postprocess.graph is None or m.inputs or m.stateful:
                print(f"  {m.name}: skipped (needs both stage graphs, one model input, no state)")
                continue
            frames = [s.raw for s in bundle.golden()]
            p = open_paths(bundle, settings, work)
            verdict = compare(p, frames)
            for fn in (p.separate, p.merged_run):  # warm both: first runs allocate
                for raw in frames[:4]:
                    fn(raw)
            t0 = time.perf_counter()
            p.separate(frames[0])
            n = args.frames or (48 if time.perf_counter() - t0 < 0.02 else 12)
            sep: list[tuple[float, float]] = []
            mer: list[tuple[float, float]] = []
            psep: list[tuple[float, float]] = []
            pmer: list[tuple[float, float]] = []
            stream = [frames[i % len(frames)] for i in range(n)]
            for _ in range(args.rounds):
                sep.append(time_path(p.separate, frames, n))
                mer.append(time_path(p.merged_run, frames, n))
                psep.append(p.pipelined(stream, merged=False))
                pmer.append(p.pipelined(stream, merged=True))
            rows.append((bundle.manifest.name, len(frames), n, sep, mer, verdict))
            rows.append((bundle.manifest.name + " pipe", len(frames), n, psep, pmer, verdict))
            print(f"  {bundle.manifest.name}: done, load {os.getloadavg()[0]:.2f}", flush=True)
    print()
    print("one frame at a time: median per frame (wall; the thread's CPU); 'pipe': a stream through threads as the\n"
          "pipeline runs it (separate: pre | model | post threads; merged: one), per frame (wall; the process's CPU)")
    print(f"{'bundle':22} {'path':9} {'wall ms/frame':>14} {'cpu ms/frame':>13}   per-round merged/separate (wall; cpu)")
    for name, nf, n, sep, mer, verdict in rows:
        rw = [m[0] / s[0] for s, m in zip(sep, mer)]
        rc = [m[1] / s[1] for s, m in zip(sep, mer)]
        for label, series in (("separate", sep), ("merged", mer)):
            print(f"{name:22} {label:9} {statistics.median(x[0] for x in series):14.3f} "
                  f"{statistics.median(x[1] for x in series):13.3f}")
        print(f"{'':22} {'ratio':9} {statistics.median(rw):14.3f} {statistics.median(rc):13.3f}   "
              f"wall {' '.join(f'{r:.3f}' for r in rw)}; cpu {' '.join(f'{r:.3f}' for r in rc)}")
        print(f"{'':22} golden frames {nf}, {n} timed per round; merged vs separate: {verdict}")
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
