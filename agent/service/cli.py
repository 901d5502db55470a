"""The `edge-agent` command line: run, bundle tools, provider detection, the self-test, config checks."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from agent import __version__
from agent.errors import AgentError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_SELECTED = 0, 1, 2, 3


@contextmanager
def bundle_dir(path: Path) -> Iterator[Path]:
    """A bundle directory as given, or a `.tar.gz` unpacked safely into a temporary one."""
    from agent.bundle.archive import unpack

    if path.is_dir():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="edge-agent-bundle-") as tmp:
        yield unpack(path, Path(tmp) / "bundle")


def _cmd_bundle_verify(args: argparse.Namespace) -> int:
    from agent.bundle.load import load_bundle
    from agent.bundle.signing import verify_signature

    with bundle_dir(args.path) as root:
        b = load_bundle(root)
        sig = verify_signature(root, args.pubkey) if args.pubkey else None
    m = b.manifest
    signed = f", signature by key {sig.key_id}" if sig else ""
    print(f"OK {b.identity}: schema, {len(m.files)} file hashes, {len(m.variants)} variant contracts, "
          f"{len(m.golden)} golden samples{signed}")
    return EXIT_OK


def _cmd_bundle_keygen(args: argparse.Namespace) -> int:
    from agent.bundle.signing import keygen

    kid = keygen(args.private, args.public)
    print(f"key {kid}: private {args.private} (keep it off devices), public {args.public} (updates.trusted_keys)")
    return EXIT_OK


def _cmd_bundle_sign(args: argparse.Namespace) -> int:
    from agent.bundle.load import load_bundle
    from agent.bundle.signing import sign_bundle

    b = load_bundle(args.dir)  # sign only what verifies
    kid = sign_bundle(args.dir, args.key)
    print(f"signed {b.identity} with key {kid}")
    return EXIT_OK


def _store(args: argparse.Namespace):
    from agent.updates.store import BundleStore

    cfg = _load_cfg(args.config)
    return BundleStore((args.state_dir or cfg.state_dir) / "store")


def _cmd_bundle_list(args: argparse.Namespace) -> int:
    store = _store(args)
    for e in store.entries():
        marks = ",".join(m for m, on in (("current", e.current), ("committed", e.committed)) if on)
        print(f"{e.id:56} {marks}")
    return EXIT_OK


def _cmd_bundle_activate(args: argparse.Namespace) -> int:
    from agent.bundle.load import load_bundle

    store = _store(args)
    bid = args.id
    if bid == "previous":
        bid = store.previous_committed()
        if bid is None:
            print("edge-agent: no previous committed bundle in the store", file=sys.stderr)
            return EXIT_ERROR
    load_bundle(store.path(bid))
    store.commit(bid)
    print(f"committed {bid}; restart or reload the agent to serve it (it is self-tested at boot)")
    return EXIT_OK


def _cmd_bundle_inspect(args: argparse.Namespace) -> int:
    from agent.bundle.load import load_bundle
    from agent.proof.inspect import render_text, summarize

    with bundle_dir(args.path) as root:
        summary = summarize(load_bundle(root))
    print(json.dumps(summary, indent=2) if args.json else render_text(summary))
    return EXIT_OK


def _cmd_bundle_pack(args: argparse.Namespace) -> int:
    from agent.bundle.archive import pack
    from agent.bundle.load import load_bundle

    b = load_bundle(args.dir)  # never ship a bundle that would not load
    out = pack(args.dir, args.out)
    print(f"packed {b.identity} -> {out} ({out.stat().st_size:,} bytes)")
    return EXIT_OK


def _cmd_bundle_unpack(args: argparse.Namespace) -> int:
    from agent.bundle.archive import unpack
    from agent.bundle.load import load_bundle

    out = unpack(args.archive, args.dir)
    try:
        b = load_bundle(out)
    except AgentError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    print(f"unpacked {b.identity} -> {out}")
    return EXIT_OK


def _cmd_bundle_create(args: argparse.Namespace) -> int:
    from agent.bundle.create import CreateOptions, create_bundle

    out = create_bundle(CreateOptions(
        model=args.model, spec=args.spec, calibration=args.calibration, golden=args.golden, out=args.out,
        heldout=args.heldout, labels=args.labels, method=args.method, per_channel=not args.no_per_channel,
        exclude_nodes=tuple(args.exclude_node), exclude_op_types=tuple(args.exclude_op_type),
        int8=not args.no_int8, fp16=args.fp16, calibration_limit=args.calibration_limit,
        max_top1_drop=args.max_top1_drop, min_agreement=args.min_agreement, keep_low_quality=args.keep_low_quality,
    ))
    print(f"created {out}")
    return EXIT_OK


def _load_cfg(path: Path | None):
    from agent.config import Config, load_config

    return load_config(path) if path else Config()


def _cmd_providers(args: argparse.Namespace) -> int:
    from agent.proof.probe import detect_providers

    cfg = _load_cfg(args.config)
    statuses = detect_providers(cfg.providers.order, cfg.providers.options, cfg.session)
    if args.json:
        print(json.dumps([s.to_dict() for s in statuses], indent=2))
        return EXIT_OK
    print(f"{'provider':28} {'listed':6} {'usable':6} {'nodes':>7}  effective / reason")
    for s in statuses:
        nodes = f"{s.nodes_on_provider}/{s.total_nodes}" if s.total_nodes else "-"
        detail = ", ".join(s.effective) if s.usable else (s.reason or "")
        print(f"{s.name:28} {'yes' if s.listed else 'no':6} {'yes' if s.usable else 'NO':6} {nodes:>7}  {detail}")
    return EXIT_OK


def _cmd_selftest(args: argparse.Namespace) -> int:
    from agent.proof.isolation import CrashLedger, prove_in_child

    cfg = _load_cfg(args.config)
    state = args.state_dir or cfg.state_dir
    if args.forget_crashes:
        n = CrashLedger(state / "selftest").forget()
        print(f"forgot {n} crash record(s) in {state / 'selftest'}", file=sys.stderr)
        if args.bundle is None:
            return EXIT_OK
    if args.bundle is None:
        print("edge-agent: selftest needs --bundle DIR (or only --forget-crashes)", file=sys.stderr)
        return EXIT_USAGE
    extra = [a for flag, v in (("--provider", args.provider), ("--variant", args.variant),
                               ("--latency-runs", args.latency_runs)) if v for a in (flag, str(v))]
    with bundle_dir(args.bundle) as root:  # proven in a child: a crashing provider is a verdict, not exit 139
        proof = prove_in_child(root, state, args.config or cfg, cfg.updates.selftest_timeout_s,
                               use_cache=not args.no_cache, extra_args=extra)
    if proof.report is None:
        print(f"edge-agent: {proof.error}", file=sys.stderr)
        return EXIT_ERROR
    doc = proof.report
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_selftest(doc))
        print(f"report: {state / 'selftest' / 'report.json'}")
    if not proof.passed:
        print(f"edge-agent: {proof.reason}", file=sys.stderr)
        return EXIT_NOT_SELECTED
    return EXIT_OK


def render_selftest(doc: dict) -> str:
    short = lambda p: p.replace("ExecutionProvider", "")  # noqa: E731
    lines = [f"self-test of {doc['bundle']['name']} v{doc['bundle']['version']} "
             f"({'cached verdict re-checked' if doc['cached'] else 'full'}, {doc['duration_ms']:.0f} ms)",
             f"{'candidate':22} {'runs on':14} {'nodes':18} {'parity':22} {'p50/p95 ms':14} verdict"]
    for c in doc["candidates"]:
        place = c.get("placement") or {}
        nodes = ",".join(f"{short(k)}:{v}" for k, v in (place.get("nodes_by_provider") or {}).items()) or "-"
        par = c.get("parity") or {}
        parity = (f"top1 {par['top1_agreement']:.2f} cos {par['min_cosine']:.4f}" if "top1_agreement" in par
                  else (f"cos {par['min_cosine']:.4f}" if par else "-"))
        lat = c.get("latency")
        lat_s = f"{lat['p50_ms']:.2f}/{lat['p95_ms']:.2f}" if lat else "-"
        eff = ",".join(short(p) for p in c.get("effective_providers") or []) or "-"
        verdict = "PASS" if c["passed"] else ("-" if c["status"] == "not_tried" else "FAIL")
        lines.append(f"{short(c['provider']) + ':' + c['variant']:22} {eff:14} {nodes:18} {parity:22} {lat_s:14} {verdict}")
        for r in c["reasons"]:
            lines.append(f"    {r}")
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    for c in doc.get("crashes", []):
        lines.append(f"crashed: {c['reason']}")
    sel = doc["selected"]
    lines.append(f"selected: {short(sel['provider'])}:{sel['variant']}" if sel else f"selected: nothing: {doc['reason']}")
    return "\n".join(lines)


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.service.daemon import Agent, demo_config

    cfg = _load_cfg(args.config) if args.config else demo_config()
    if args.max_frames is not None:
        from dataclasses import replace

        cfg = replace(cfg, pipeline=replace(cfg.pipeline, max_frames=args.max_frames))
    return Agent(cfg).run()


def _cmd_push(args: argparse.Namespace) -> int:
    from agent.link.push import push

    host, _, port = args.broker.partition(":")
    password = Path(args.password_file).read_text().strip() if args.password_file else None
    result = push(args.bundle, args.device, host, int(port or 1883), prefix=args.prefix,
                  chunk_size=args.chunk_size, timeout_s=args.timeout, tls_ca=args.tls_ca,
                  username=args.username, password=password)
    print(json.dumps(result))
    return EXIT_OK if result["state"] == "committed" else EXIT_ERROR


def _cmd_monitor(args: argparse.Namespace) -> int:
    from agent.link.monitor import run_monitor

    host, _, port = args.broker.partition(":")
    password = None
    if args.password_file:
        password = Path(args.password_file).read_text().strip()
    return run_monitor(host, int(port or (8883 if args.tls_ca else 1883)), args.root, args.once, args.wait, args.json,
                       tls_ca=args.tls_ca, username=args.username, password=password, insecure=args.tls_insecure)


def _cmd_config_check(args: argparse.Namespace) -> int:
    from agent.config import config_to_dict, load_config

    cfg = load_config(args.file)
    print(json.dumps(config_to_dict(cfg), indent=2))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge-agent", description="ONNX Runtime inference agent that proves its model on the device.")
    p.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--log-json", dest="log_json", action="store_const", const=True, default=None,
                     help="JSON log lines (default when stderr is not a terminal)")
    fmt.add_argument("--log-pretty", dest="log_json", action="store_const", const=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("bundle", help="verify, inspect, pack, unpack and create model bundles")
    bsub = b.add_subparsers(dest="bundle_command", required=True, metavar="ACTION")
    v = bsub.add_parser("verify", help="check schema, hashes, contracts, golden samples (and the signature)")
    v.add_argument("path", type=Path, help="bundle directory or .tar.gz")
    v.add_argument("--pubkey", type=Path, action="append", default=[], help="trusted public key (repeatable)")
    v.set_defaults(func=_cmd_bundle_verify)
    kg = bsub.add_parser("keygen", help="make an Ed25519 signing key pair")
    kg.add_argument("--private", type=Path, required=True)
    kg.add_argument("--public", type=Path, required=True)
    kg.set_defaults(func=_cmd_bundle_keygen)
    sg = bsub.add_parser("sign", help="sign a bundle directory's manifest (writes bundle.sig)")
    sg.add_argument("dir", type=Path)
    sg.add_argument("--key", type=Path, required=True)
    sg.set_defaults(func=_cmd_bundle_sign)
    for name, fn, hlp in (("list", _cmd_bundle_list, "bundles in the device's store"),
                          ("activate", _cmd_bundle_activate, "commit a stored bundle (or 'previous')"),
                          ("rollback", _cmd_bundle_activate, "commit the previous committed bundle")):
        sp = bsub.add_parser(name, help=hlp)
        if name == "activate":
            sp.add_argument("id")
        else:
            sp.set_defaults(id="previous")
        sp.add_argument("--config", type=Path)
        sp.add_argument("--state-dir", type=Path)
        sp.set_defaults(func=fn)
    i = bsub.add_parser("inspect", help="print a readable summary")
    i.add_argument("path", type=Path)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_bundle_inspect)
    pk = bsub.add_parser("pack", help="bundle directory -> .tar.gz (after verifying it)")
    pk.add_argument("dir", type=Path)
    pk.add_argument("out", type=Path)
    pk.set_defaults(func=_cmd_bundle_pack)
    up = bsub.add_parser("unpack", help=".tar.gz -> bundle directory (safely, then verified)")
    up.add_argument("archive", type=Path)
    up.add_argument("dir", type=Path)
    up.set_defaults(func=_cmd_bundle_unpack)
    c = bsub.add_parser("create", help="make a bundle (FP32 + INT8, golden samples) from your ONNX model")
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--spec", type=Path, required=True, help="YAML: name, version, task, frame, preprocess, postprocess")
    c.add_argument("--calibration", type=Path, required=True, help=".npz with 'raw' or a directory of images")
    c.add_argument("--golden", type=Path, required=True, help=".npz (optionally with reference.<output>) or images")
    c.add_argument("--heldout", type=Path, help=".npz with 'raw' and optional 'label' for quality measurement")
    c.add_argument("--labels", type=Path, help="class names, one per line")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--method", choices=["minmax", "entropy", "percentile"], default="minmax")
    c.add_argument("--no-per-channel", action="store_true")
    c.add_argument("--exclude-node", action="append", default=[], help="keep this node in float (repeatable)")
    c.add_argument("--exclude-op-type", action="append", default=[], help="keep nodes of this op type in float")
    c.add_argument("--no-int8", action="store_true")
    c.add_argument("--fp16", action="store_true")
    c.add_argument("--calibration-limit", type=int, default=256)
    c.add_argument("--max-top1-drop", type=float, default=1.0, help="INT8 bound, held-out top-1 points under FP32")
    c.add_argument("--min-agreement", type=float, default=0.97, help="INT8 bound on agreement with FP32 without labels")
    c.add_argument("--keep-low-quality", action="store_true", help="keep an INT8 variant under the bound, marked")
    c.set_defaults(func=_cmd_bundle_create)

    pr = sub.add_parser("providers", help="which execution providers really work on this device")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--config", type=Path)
    pr.set_defaults(func=_cmd_providers)

    s = sub.add_parser("selftest", help="prove a bundle on this device and select a candidate")
    s.add_argument("--bundle", type=Path, help="bundle directory or .tar.gz (required unless --forget-crashes)")
    s.add_argument("--forget-crashes", action="store_true",
                   help="clear the crash records, so steps that crashed the self-test are tried again")
    s.add_argument("--config", type=Path)
    s.add_argument("--state-dir", type=Path, help="where the report, markers and cache go (default: config)")
    s.add_argument("--json", action="store_true", help="print the full JSON report")
    s.add_argument("--provider", help="pin a provider, e.g. CPUExecutionProvider")
    s.add_argument("--variant", help="pin a variant, e.g. int8")
    s.add_argument("--no-cache", action="store_true", help="ignore a cached verdict")
    s.add_argument("--latency-runs", type=int, help="override the bundle's latency run count")
    s.set_defaults(func=_cmd_selftest)

    r = sub.add_parser("run", help="boot, self-test and serve (no --config: the demo bundle on demo frames)")
    r.add_argument("--config", type=Path)
    r.add_argument("--max-frames", type=int, help="stop after this many frames")
    r.set_defaults(func=_cmd_run)

    pu = sub.add_parser("push", help="push a bundle .tar.gz to a device over MQTT and wait for its verdict")
    pu.add_argument("--device", required=True)
    pu.add_argument("--bundle", type=Path, required=True)
    pu.add_argument("--broker", default="127.0.0.1:1883", help="HOST[:PORT]")
    pu.add_argument("--prefix", help="topic prefix (default edge/<device>/)")
    pu.add_argument("--chunk-size", type=int, default=256 * 1024)
    pu.add_argument("--timeout", type=float, default=600)
    pu.add_argument("--tls-ca")
    pu.add_argument("--username")
    pu.add_argument("--password-file")
    pu.set_defaults(func=_cmd_push)

    mo = sub.add_parser("monitor", help="live table of every device's availability and health (operator side)")
    mo.add_argument("--broker", default="127.0.0.1:1883", help="HOST[:PORT]")
    mo.add_argument("--root", default="edge", help="topic root above the device ids")
    mo.add_argument("--tls-ca", help="CA file: connect with TLS, verifying the broker")
    mo.add_argument("--tls-insecure", action="store_true", help="TLS without verification (development only)")
    mo.add_argument("--username")
    mo.add_argument("--password-file")
    mo.add_argument("--json", action="store_true")
    mo.add_argument("--once", action="store_true", help="print once and exit (after --wait seconds)")
    mo.add_argument("--wait", type=float, default=1.0, help="seconds to collect retained state first")
    mo.set_defaults(func=_cmd_monitor)

    cf = sub.add_parser("config", help="validate a config file")
    csub = cf.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cc = csub.add_parser("check", help="validate and print the effective settings")
    cc.add_argument("file", type=Path)
    cc.set_defaults(func=_cmd_config_check)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from agent.logsetup import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    try:
        return args.func(args)
    except AgentError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
