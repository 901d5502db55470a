"""The self-test child process: load the bundle, probe each provider, try candidates, write the report.

Run by `agent.proof.isolation.prove_in_child`, never in the serving process. Each step that can kill
a process is marked first, so the parent can name it; steps with a crash record are skipped.
Fault injection for tests (`EDGE_AGENT_FAULT`) lives here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.fsio import read_json, write_json_atomic
from agent.logsetup import configure_logging, get_logger
from agent.proof.isolation import CrashLedger, bundle_digest, inject_fault, mark_step, parse_faults
from agent.proof.terms import ProviderStatus

log = get_logger("selftest_child")

FAULT_ENV = "EDGE_AGENT_FAULT"


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)
    configure_logging(os.environ.get("EDGE_AGENT_CHILD_LOG_LEVEL", "warning"), True)
    try:
        doc = {"report": _prove(args)}
    except AgentError as exc:
        doc = {"error": str(exc)}
    write_json_atomic(args.out, doc)
    if "error" in doc:
        return 2
    return 0 if doc["report"]["passed"] else 3


def _prove(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    from agent.bundle.load import load_bundle
    from agent.config import Config, load_config
    from agent.proof import selftest
    from agent.proof.probe import detect_providers, provider_versions

    if args.config_pickle:
        cfg = pickle.loads(args.config_pickle.read_bytes())  # written by our parent, in its private temp dir
    else:
        cfg = load_config(args.config) if args.config else Config()
    opts = selftest.options_from_config(cfg, provider=args.provider, variant=args.variant,
                                        use_cache=False if args.no_cache else None)
    if args.latency_runs:
        opts = dataclasses.replace(opts, latency_runs=args.latency_runs)
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

    mark_step(directory, "load")  # the contract check opens every variant
    inject_fault("load", faults)
    bundle = load_bundle(args.bundle)

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

    cached = read_json(directory / "cache.json") or {}
    if opts.use_cache and f"candidate:{cached.get('candidate')}" in crashed:
        log.warning("selftest.cached_winner_crashed", candidate=cached.get("candidate"))
        opts = dataclasses.replace(opts, use_cache=False)

    # The self-test probes and evaluates through these module functions: the child gives it the probes
    # it already made (one step each), and the fault hook in front of each trial.
    evaluate = selftest.evaluate

    def evaluate_with_fault(bundle: Any, c: Any, *a: Any, **kw: Any) -> Any:
        inject_fault(f"candidate:{c.key}", faults)
        return evaluate(bundle, c, *a, **kw)

    prove = selftest.prove

    def prove_with_fault(bundle: Any, c: Any, *a: Any, **kw: Any) -> Any:  # the full self-test's trials
        inject_fault(f"candidate:{c.key}", faults)
        return prove(bundle, c, *a, **kw)

    selftest.detect_providers = lambda *a, **kw: list(statuses)  # type: ignore[assignment]
    selftest.evaluate = evaluate_with_fault  # type: ignore[assignment]
    selftest.prove = prove_with_fault  # type: ignore[assignment]
    report = selftest.run_selftest(bundle, args.state_dir, opts)
    return report.to_dict()


if __name__ == "__main__":
    sys.exit(main())
