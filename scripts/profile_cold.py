"""Where a cold `edge-agent run --max-frames 1` spends its CPU, per part and per process (a script, not a test).

Runs the agent cold (a fresh state directory) with this file wrapped around the agent process and around
its self-test child (EDGE_AGENT_SELFTEST_WRAPPER), each recording CPU seconds (`time.process_time`, every
thread) at its milestones and around the parts of the boot: imports, config, the child's bundle load,
contract sessions, provider probes and proof (whose own parts are the report's `costs`), the agent's
bundle load, serving session, source open, and its first result. Then the imports alone, by package, CPU
ms in the order the agent imports them (each package with what it pulls in that was not imported yet).

  python scripts/profile_cold.py [--bundle DIR] [--video FILE] [--runs 1]

Without --video it serves the demo frames (a folder of PNGs: no reduced-decode check). Prints the load
average: on a loaded machine wall seconds are mostly waiting, CPU seconds are the steadier figure.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.process_time()

if sys.argv[1:2] in (["--as-agent"], ["--as-child"]):  # the wrapper, in the agent or in its child
    import threading

    LOG = open(os.environ["COLD_LOG"], "a")
    WHO = "agent" if sys.argv[1] == "--as-agent" else "child"

    def mark(what: str, cpu: float | None = None) -> None:
        LOG.write(json.dumps({"who": WHO, "what": what, "cpu": time.process_time() if cpu is None else cpu,
                              "wall": time.time()}) + "\n")
        LOG.flush()

    def timed(owner: Any, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def g(*a: Any, **kw: Any) -> Any:
            c0, w0 = time.process_time(), time.time()
            try:
                return f(*a, **kw)
            finally:
                LOG.write(json.dumps({"who": WHO, "part": label, "cpu_s": time.process_time() - c0,
                                      "wall_s": time.time() - w0, "thread": threading.current_thread().name}) + "\n")
                LOG.flush()
        setattr(owner, name, g)

    mark("interpreter started", T0)
    if WHO == "agent":
        import agent.service.cli as cli

        try:  # as `_cmd_run` does before its imports (and `main` sets this first, as the spare's environment)
            from agent.proof import spare

            os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
            spare.start(sys.argv[sys.argv.index("--config") + 1])
        except ImportError:
            pass  # an agent before the spare child
        import agent.service.daemon  # noqa: F401

        mark("imports done")
        import agent.config as config
        import agent.service.boot as boot
        import agent.service.controller as controller
        import agent.serving.sinks as sinks

        timed(config, "load_config", "config: read and validated")
        timed(boot, "prove", "while the child proves (relay, PyAV warm-up)")
        timed(boot, "load_bundle", "bundle: schema, hashes, golden checks")
        timed(boot, "open_engine", "serving session")
        timed(controller, "open_source", "source open")
        first: list[int] = []
        for nm in ("write_encoded", "write"):
            def once(self: Any, *a: Any, _f: Any = getattr(sinks.JsonLinesSink, nm), **kw: Any) -> Any:
                if not first:
                    first.append(1)
                    mark("first result")
                return _f(self, *a, **kw)
            setattr(sinks.JsonLinesSink, nm, once)
        i = sys.argv.index("-m")
        sys.exit(cli.main(sys.argv[i + 2:]))
    else:
        import agent.service.selftest_child as child

        getattr(child, "_import_proof", lambda: None)()  # (an agent before the spare child imports them later)
        mark("imports done")
        import agent.bundle.load as load
        import agent.proof.probe as probe
        import agent.proof.selftest as selftest

        timed(load, "load_bundle", "bundle: schema, hashes, golden checks")
        timed(load, "check_variant_contract", "contract session (one per variant)")
        timed(probe, "detect_providers", "provider probe (one per provider)")
        timed(selftest, "run_selftest", "proof (the report's costs)")
        i = sys.argv.index("-m")
        code = child.main(sys.argv[i + 2:])
        mark("exit")
        sys.exit(code)


import argparse  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

IMPORT_ORDER = ("argparse", "structlog", "numpy", "yaml", "jsonschema", "onnxruntime", "cv2", "agent.config",
                "agent.bundle.load", "agent.proof.probe", "agent.proof.isolation", "agent.proof.selftest",
                "agent.serving.pipeline", "agent.service.controller", "agent.service.cli")


def imports_by_package() -> list[tuple[str, float]]:
    """CPU ms of each import in a fresh interpreter, in order (each includes what it pulls in that is new)."""
    code = ("import time, json, sys\nout = []\nfor m in sys.argv[1:]:\n    t = time.process_time()\n"
            "    __import__(m)\n    out.append((m, (time.process_time() - t) * 1000))\nprint(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code, *IMPORT_ORDER], capture_output=True, text=True, check=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    return [(m, float(ms)) for m, ms in json.loads(r.stdout)]


def one_run(bundle: Path, video: Path | None, tmp: Path) -> None:
    log = tmp / "cold.jsonl"
    source = {"type": "video", "path": str(video)} if video else {"type": "folder",
                                                                  "path": str(Path(ROOT) / "models/demo-frames/digits")}
    cfg = tmp / "agent.yaml"
    cfg.write_text(json.dumps({"state_dir": str(tmp / "state"), "bundle": str(bundle), "source": source}))
    me = os.path.abspath(__file__)
    env = {**os.environ, "COLD_LOG": str(log), "PYTHONPATH": ROOT,
           "EDGE_AGENT_SELFTEST_WRAPPER": f"{sys.executable} {me} --as-child"}
    load0 = os.getloadavg()[0]
    subprocess.run([sys.executable, me, "--as-agent", "-m", "agent", "--log-level", "warning", "run", "--config",
                    str(cfg), "--max-frames", "1"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    w0 = min(r["wall"] for r in rows if "wall" in r)
    print(f"\n{'process':6} {'part or milestone':44} {'CPU ms':>8} {'wall ms':>8}   (load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f})")
    for r in rows:
        if "part" in r:
            print(f"{r['who']:6}   {r['part']:42} {r['cpu_s'] * 1000:8.1f} {r['wall_s'] * 1000:8.1f}")
        else:
            print(f"{r['who']:6} {r['what']:44} {'@' + format(r['cpu'] * 1000, '.0f'):>8} "
                  f"{'@' + format((r['wall'] - w0) * 1000, '.0f'):>8}")
    report = json.loads((tmp / "state" / "selftest" / "report.json").read_text())
    print(f"the proof's own parts (report costs; {report['cpu_ms']:.0f} ms of CPU in all):")
    for c in report["costs"]:
        print(f"         {c['part'][:64]:64} {c['cpu_ms']:8.1f} {c['wall_ms']:8.1f}")
    sel = report["selected"] or {}
    print(f"selected {sel.get('provider')}:{sel.get('variant')}, decode max_scale "
          f"{(report.get('decode') or {}).get('max_scale')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path(ROOT) / "models" / "digits-classifier")
    ap.add_argument("--video", type=Path, help="serve this video file (default: the demo's folder of PNGs)")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    print(f"cold `edge-agent run --max-frames 1`: {args.bundle}, source {args.video or 'the demo frames folder'}; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}, agent/ byte-compiled: "
          f"{any((Path(ROOT) / 'agent' / '__pycache__').glob('*.pyc'))}")
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            one_run(args.bundle, args.video, Path(tmp))
    print("\nimports in a fresh interpreter, CPU ms, in this order (each with what it pulls in that is new):")
    for m, ms in imports_by_package():
        print(f"   {m:28} {ms:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
