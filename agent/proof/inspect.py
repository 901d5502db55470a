"""`bundle inspect`: a readable summary of a bundle (variants, ops by type, sizes, quality).

Op counts come from ORT's graph-assignment info on an unoptimised CPU session, so inspecting needs
no build tools on the device.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from agent.bundle.load import ANSWERS_FILE, Bundle
from agent.proof.session import open_session
from agent.proof.terms import CPU, SessionSettings


def ops_by_type(model: Path) -> dict[str, int]:
    opened = open_session(model, CPU, settings=SessionSettings(graph_optimization="disable"))
    counts: Counter[str] = Counter()
    for per in opened.placement.op_types_by_provider.values():
        counts.update(per)
    return dict(counts.most_common())


def summarize(bundle: Bundle) -> dict[str, Any]:
    m = bundle.manifest
    variants = []
    for v in m.variants:
        path = bundle.path(v.file)
        variants.append({
            "name": v.name, "file": v.file, "precision": v.precision, "size_bytes": path.stat().st_size,
            "providers": list(v.providers), "quality": dict(v.quality), "ops": ops_by_type(path),
            "recorded": dict(v.recorded), "below_floor": v.below_floor,
        })
    return {
        "name": m.name, "version": m.version, "label": m.label, "created": m.created, "task": m.task,
        "manifest_sha256": bundle.manifest_sha256,
        "input": {"name": m.input.name, "dtype": m.input.dtype, "shape": list(m.input.shape)},
        "inputs": list(m.raw.get("inputs", [])),
        "frame": {k: v for k, v in vars(m.frame).items() if v not in (0, None)},
        "outputs": [{"name": o.name, "dtype": o.dtype, "shape": list(o.shape),
                     **({"batch_axis": o.batch_axis} if o.batch_axis else {})} for o in m.outputs],
        # bundle create --allow-unproven-decoder: the warning travels with the bundle
        **({"unproven_decoder": m.source["unproven_decoder"]} if m.source.get("unproven_decoder") else {}),
        "preprocess": m.raw["preprocess"], "postprocess": m.raw["postprocess"],
        "variants": variants, "preference": {k: list(v) for k, v in m.preference.items()},
        "selftest": m.raw["selftest"], "golden_samples": len(m.golden), "files": len(m.files),
        # stage graphs (issue 21): each file with its hash and ops; the package's own answers, when carried
        "stages": {stage: {"file": rel, "sha256": m.files[rel], "ops": ops_by_type(bundle.path(rel))}
                   for stage, rel in m.stage_files.items()},
        "answers": ANSWERS_FILE if bundle.answers_path() is not None else None,
    }


def render_text(s: dict[str, Any]) -> str:
    lines = [
        f"bundle   {s['name']} v{s['version']} ({s['label']}), created {s['created']}, task {s['task']}",
        f"manifest sha256 {s['manifest_sha256']}",
        f"input    {s['input']['name']} {s['input']['dtype']} {s['input']['shape']}  <- frame {s['frame']}",
        *(["inputs   " + ", ".join(f"{x['name']} ({x['kind']}) {x['dtype']} {x['shape']}" for x in s["inputs"])]
          if s.get("inputs") else []),
        "outputs  " + ", ".join(f"{o['name']} {o['dtype']} {o['shape']}"
                                + (f" (batch axis {o['batch_axis']})" if o.get("batch_axis") else "") for o in s["outputs"]),
        f"preproc  {s['preprocess']}",
        f"postproc {s['postprocess']}",
        *(["stages   " + "; ".join(f"{k} {v['file']} (sha256 {v['sha256'][:12]}...)" for k, v in s["stages"].items())]
          if s.get("stages") else []),
        f"golden   {s['golden_samples']} samples; {s['files']} files hashed; package answers: "
        + (s["answers"] if s.get("answers") else "none (fidelity is judged against our own decoding of the source's "
                                                   "tensors)"),
        "",
        f"{'variant':8} {'precision':9} {'size':>10} {'top-1':>7} {'agree':>7} {'cpu p50':>9}  providers",
    ]
    for v in s["variants"]:
        q = v["quality"]
        top1 = f"{q['heldout_top1']:.4f}" if "heldout_top1" in q else "-"
        agree = q.get("heldout_top1_agreement", q.get("golden_top1_agreement"))
        agree_s = f"{agree:.4f}" if isinstance(agree, (int, float)) else "-"
        p50 = f"{q['cpu_p50_ms']:.2f} ms" if "cpu_p50_ms" in q else "-"
        lines.append(f"{v['name']:8} {v['precision']:9} {v['size_bytes']:>10,} {top1:>7} {agree_s:>7} {p50:>9}  "
                     + ", ".join(p.replace('ExecutionProvider', '') for p in v["providers"]))
    if s.get("unproven_decoder"):
        lines.append(f"UNPROVEN DECODER: {s['unproven_decoder']}")
    for v in s["variants"]:
        if v.get("below_floor"):
            lines.append(f"BELOW FLOOR {v['name']}: {v['below_floor']} (never selected unless the config pins it)")
    for v in s["variants"]:
        ops = ", ".join(f"{k} {n}" for k, n in v["ops"].items())
        lines.append(f"ops {v['name']}: {ops}")
    lines.append(f"selftest: {s['selftest']}")
    return "\n".join(lines)
