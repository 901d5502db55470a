"""Exercise the CUDA (and TensorRT, where installed) candidates for real on an NVIDIA GPU machine.

Needs `onnxruntime-gpu` with its CUDA/cuDNN libraries (e.g. `pip install 'onnxruntime-gpu[cuda,cudnn]'`).
Prints the provider probe, then, per GPU provider, a pinned self-test of the demo bundle (placement,
parity, latency) next to a raw `InferenceSession.run` loop on the same provider, and writes all of it
as JSON (--out). Tests and CI never need this; it is how a GPU claim gets measured, not assumed.

Usage: python scripts/check_cuda.py [--bundle models/digits-classifier] [--out cuda-check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.bundle.load import load_bundle  # noqa: E402
from agent.config import Config  # noqa: E402
from agent.proof.probe import detect_providers  # noqa: E402
from agent.proof.terms import CUDA, TENSORRT  # noqa: E402
from agent.proof.selftest import options_from_config, run_selftest  # noqa: E402
from agent.proof.session import measure_latency  # noqa: E402


def raw_p50(model: Path, provider: str, tensor: np.ndarray, runs: int = 300) -> float:
    sess = ort.InferenceSession(str(model), providers=[provider, "CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return measure_latency(lambda t: sess.run(None, {name: t}), tensor, warmup=20, runs=runs).p50_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=ROOT / "models" / "digits-classifier")
    ap.add_argument("--out", type=Path, default=Path("cuda-check.json"))
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    result: dict = {"onnxruntime": ort.__version__, "listed": ort.get_available_providers()}
    statuses = detect_providers()
    result["providers"] = [s.to_dict() for s in statuses]
    print(f"onnxruntime {ort.__version__}; listed {ort.get_available_providers()}")
    for s in statuses:
        print(f"  {s.name:28} usable={s.usable} nodes={s.nodes_on_provider}/{s.total_nodes} {s.reason or ''}")
    tensor = bundle.golden()[0].input
    result["candidates"] = []
    print(f"\n{'candidate':22} {'effective':28} {'on-provider':>11} {'p50 ms':>8} {'raw p50':>8} verdict / reasons")
    for name in (TENSORRT, CUDA):
        if not next(s for s in statuses if s.name == name).usable:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            opts = replace(options_from_config(Config(), provider=name), use_cache=False)
            report = run_selftest(bundle, Path(tmp), opts)
        for r in report.results:
            ev = r.evidence
            frac = ev.placement.fraction(name) if ev and ev.placement else 0.0
            p50 = ev.latency.p50_ms if ev and ev.latency else float("nan")
            raw = raw_p50(bundle.path(bundle.manifest.variant(r.candidate.variant).file), name, tensor)
            print(f"{r.candidate.key.replace('ExecutionProvider', ''):22} {','.join(ev.effective) if ev else '-':28} "
                  f"{frac:>10.0%} {p50:>8.3f} {raw:>8.3f} {'PASS' if r.passed else 'FAIL ' + '; '.join(r.reasons)}")
            result["candidates"].append({**r.to_dict(), "raw_p50_ms": raw})
        result.setdefault("selected", {})[name] = report.to_dict()["selected"]
    if not result["candidates"]:
        print("no usable GPU provider: nothing to exercise (see the reasons above)")
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
