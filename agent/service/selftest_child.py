"""The self-test child process: load the bundle, probe each provider, try candidates, write the report.

Run by `agent.proof.isolation.prove_in_child`, never in the serving process. Each step that can kill
a process is marked first, so the parent can name it; steps with a crash record are skipped.
Fault injection for tests (`EDGE_AGENT_FAULT`) lives here, and for the serving path in
`agent.service.serving_ledger` (read only when the variable is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.fsio import read_json, write_json_atomic
from agent.logsetup import configure_logging, get_logger
from agent.proof import spare
from agent.proof.isolation import CrashLedger, bundle_digest, inject_fault, mark_step, parse_faults
from agent.proof.terms import ProviderStatus
from agent.proof.crash_files import CACHE_FILE

log = get_logger("selftest_child")

FAULT_ENV = "EDGE_AGENT_FAULT"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [spare.SPARE_FLAG]:  # started before the agent needed it (agent.proof.spare)
        _import_proof()
        got = spare.wait_for_arguments(sys.stdin)
        if got is None:
            return 0  # not adopted: the agent exited or proved without it
        argv = got
    p = argparse.ArgumentParser(prog="python -m agent.service.selftest_child")
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", type=Path)
    p.add_argument("--config-pickle", type=Path, help="the parent's config object (private temporary file)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--crash-records", type=Path, help="where the crash records live (default: the state dir's)")
    p.add_argument("--provider")
    p.add_argument("--variant")
    p.add_argument("--latency-runs", type=int)
    p.add_argument("--latency-retries", type=int)
    p.add_argument("--serve-disproven", action="store_true", help="prove candidates disproven while serving too")
    args = p.parse_args(argv)
    configure_logging(os.environ.get("EDGE_AGENT_CHILD_LOG_LEVEL", "warning"), True)
    doc: dict[str, Any]
    try:
        doc = {"report": _prove(args)}
    except AgentError as exc:
        doc = {"error": str(exc)}
    write_json_atomic(args.out, doc)
    if "error" in doc:
        return 2
    return 0 if doc["report"]["passed"] else 3


def _import_proof() -> None:
    """What `_prove` imports, imported while a spare waits for its arguments."""
    import cv2  # noqa: F401  preprocessing and the reduced-decode check
    import onnxruntime  # noqa: F401

    import agent.bundle.load  # noqa: F401
    import agent.config  # noqa: F401
    import agent.proof.probe  # noqa: F401
    import agent.proof.selftest  # noqa: F401


def _prove(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    from agent.bundle.load import check_variant_contract, load_bundle
    from agent.config import Config, load_config
    from agent.proof import selftest
    from agent.proof.probe import detect_providers, provider_versions

    if args.config_pickle:
        cfg = pickle.loads(args.config_pickle.read_bytes())  # written by our parent, in its private temp dir
    else:
        cfg = load_config(args.config) if args.config else Config()
    opts = selftest.options_from_config(cfg, provider=args.provider, variant=args.variant,
                                        use_cache=False if args.no_cache else None)
    opts = dataclasses.replace(opts, latency_runs=args.latency_runs or opts.latency_runs,
                               serve_disproven=args.serve_disproven)  # boot.last_resort's second proof
    if args.latency_retries is not None:
        opts = dataclasses.replace(opts, policy=dataclasses.replace(opts.policy, latency_retries=args.latency_retries))
    from agent.bundle.load import read_manifest

    manifest = read_manifest(args.bundle)[0]
    # "step@<version>=ACTION" hits only that bundle version (an update), "step=ACTION" every bundle
    faults = {k.removesuffix(f"@{manifest.version}"): v for k, v in parse_faults(os.environ.get(FAULT_ENV)).items()
              if "@" not in k or k.endswith(f"@{manifest.version}")}
    directory = args.state_dir / "selftest"
    directory.mkdir(parents=True, exist_ok=True)
    ledger = CrashLedger(directory, records_dir=args.crash_records)
    sha = bundle_digest(args.bundle)
    crashed = ledger.active(sha)

    mark_step(directory, "load")  # manifest, file hashes, golden arrays: no session
    inject_fault("load", faults)
    bundle = load_bundle(args.bundle, check_contracts=False, keep_golden=True)  # read once, for the proof too
    # Each variant's contract is its own step (it opens a session): a driver that crashes on the INT8
    # file costs that variant, and the FP32 is still tried.
    for v in bundle.manifest.variants:
        if f"contract:{v.name}" in crashed:
            log.warning("selftest.contract_skipped", variant=v.name, reason=crashed[f"contract:{v.name}"].describe())
            continue
        mark_step(directory, f"contract:{v.name}")
        inject_fault(f"contract:{v.name}", faults)
        check_variant_contract(args.bundle, bundle.manifest, v.name)
    mark_step(directory, None)
    # Each stage graph is its own step too, run on the golden samples before any candidate: a native crash
    # in the bundle's pre or post graph costs the stage (the parent then refuses the bundle naming it),
    # never a model candidate, which would only move the crash to the next candidate.
    from agent.proof.stage_proof import exercise_stage

    geometries = None
    golden = bundle.golden() if bundle.manifest.stage_files else []
    for stage in bundle.manifest.stage_files:
        mark_step(directory, f"stage:{stage}")
        inject_fault(f"stage:{stage}", faults)
        geometries = exercise_stage(bundle, stage, golden, geometries) or None
    mark_step(directory, None)

    statuses: list[ProviderStatus] = []
    for name in opts.provider_order:
        rec = crashed.get(f"probe:{name}")
        if rec is not None:
            statuses.append(ProviderStatus(name, name in ort.get_available_providers(), False, rec.describe(),
                                           versions=provider_versions(name)))
            continue
        mark_step(directory, f"probe:{name}")
        inject_fault(f"probe:{name}", faults)
        statuses += detect_providers((name,), opts.provider_options, opts.settings)
    mark_step(directory, None)

    cached = read_json(directory / CACHE_FILE, expect=dict) or {}
    cached_variant = str(cached.get("candidate") or "").rsplit(":", 1)[-1]
    if opts.use_cache and (f"candidate:{cached.get('candidate')}" in crashed or f"contract:{cached_variant}" in crashed):
        log.warning("selftest.cached_winner_crashed", candidate=cached.get("candidate"))
        opts = dataclasses.replace(opts, use_cache=False)

    # The self-test's steps, given as values: the probes this child already made (one step each), and the
    # fault hook in front of each trial. `prove` opens and checks a candidate on a full run, `evaluate`
    # re-checks a cached winner.
    def with_fault(step_fn: Any) -> Any:
        def run(bundle: Any, c: Any, *a: Any, **kw: Any) -> Any:
            inject_fault(f"candidate:{c.key}", faults)
            return step_fn(bundle, c, *a, **kw)
        return run

    def before_run(c: Any, n: int) -> None:  # "run:<provider>:<variant>#N": die on that candidate's N-th run
        inject_fault(f"run:{c.key}#{n}", faults)
        flag = faults.get(f"slow:{c.key}")  # "slow:<key>=FILE": each timed run 30 ms slower while FILE exists
        if flag and os.path.exists(flag):
            time.sleep(0.03)
        pace = faults.get(f"pace:{c.key}")  # "pace:<key>=SECONDS": each run that much slower, still progressing
        if pace:
            time.sleep(float(pace))

    if any(k.startswith("run:") for k in faults):
        # a loop that settles stops before the N-th run, and the fault would never fire
        opts = dataclasses.replace(opts, settle=False)
    seams = selftest.Seams(
        detect_providers=lambda *a, **kw: list(statuses), prove=with_fault(selftest.prove),
        evaluate=with_fault(selftest.evaluate),
        before_run=before_run if any(k.startswith(("run:", "slow:", "pace:")) for k in faults) else None)
    report = selftest.run_selftest(bundle, args.state_dir, opts, seams)
    return report.to_dict()


if __name__ == "__main__":
    code = main()
    # The verdict is on disk (written atomically) and the parent waits for this exit to read it: the
    # interpreter's teardown (every session, arena and module freed: 20-40 ms on the cold boot's critical
    # path) buys nothing, and a native crash inside it would read as a crash of the proof.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
