"""The `edge-agent` command line: run, bundle tools, provider detection, the self-test, config checks."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from agent import __version__
from agent.errors import AgentError, UsageError
from agent.service.cli_bundle import (  # noqa: F401 (handlers the parser names)
    _load_cfg,
    bundle_dir,
    _cmd_bundle_activate,
    _cmd_bundle_create,
    _cmd_bundle_inspect,
    _cmd_bundle_keygen,
    _cmd_bundle_list,
    _cmd_bundle_pack,
    _cmd_bundle_sign,
    _cmd_bundle_unpack,
    _cmd_bundle_verify,
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_SELECTED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def _apply_log_config(args: argparse.Namespace, cfg: Any) -> None:
    """The config's log.level/log.json apply unless the command line says otherwise."""
    from agent.logsetup import configure_logging

    level = args.log_level or cfg.log.level
    as_json = args.log_json if args.log_json is not None else cfg.log.json
    configure_logging(level, as_json)
    _quiet_opencv(as_json if as_json is not None else not sys.stderr.isatty(), level)


def _quiet_opencv(as_json: bool, level: str) -> None:
    """OpenCV's native logger (and FFmpeg's below it) write `[ WARN:...]` lines straight to stderr and cannot be
    handed to structlog from Python: under JSON logs they are silenced (sources report reconnects as
    structured events)."""
    if as_json:
        # FFmpeg under OpenCV logs its own `[tcp @ 0x...] Connection refused` lines; read once, at its first use
        os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # AV_LOG_QUIET
    try:
        import cv2
    except ImportError:
        return
    lv = cv2.utils.logging
    lv.setLogLevel(lv.LOG_LEVEL_SILENT if as_json else (lv.LOG_LEVEL_DEBUG if level == "debug" else lv.LOG_LEVEL_ERROR))


def _cmd_providers(args: argparse.Namespace) -> int:
    from agent.proof.probe import detect_providers

    cfg = _load_cfg(args.config)
    if args.config:
        _apply_log_config(args, cfg)
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
    from agent.proof.evidence import EvidenceLedger
    from agent.proof.isolation import CrashLedger, prove_in_child

    cfg = _load_cfg(args.config)
    if args.config:
        _apply_log_config(args, cfg)
    state = args.state_dir or cfg.state_dir
    forget = [(CrashLedger, "crash")] * args.forget_crashes + [(EvidenceLedger, "serving evidence")] * args.forget_evidence
    for ledger, what in forget:
        print(f"forgot {ledger(state / 'selftest').forget()} {what} record(s) in {state / 'selftest'}", file=sys.stderr)
    if args.bundle is None:
        if not forget:
            print("edge-agent: selftest needs --bundle DIR (or only --forget-crashes / --forget-evidence)", file=sys.stderr)
        return EXIT_OK if forget else EXIT_USAGE
    extra = [a for flag, v in (("--provider", args.provider), ("--variant", args.variant),
                               ("--latency-runs", args.latency_runs),
                               ("--latency-retries", args.latency_retries)) if v is not None and v is not False
             for a in (flag, str(v))]
    # Ctrl-C ends a self-test even when SIGINT came in ignored (a script, cron, CI start commands so): Python
    # installs its handler only for a SIGINT that is not ignored at start. The child dies with this process.
    signal.signal(signal.SIGINT, _interrupted)
    try:
        with bundle_dir(args.bundle) as root:  # proven in a child: a crashing provider is a verdict, not exit 139
            proof = prove_in_child(root, state, args.config or cfg, cfg.updates.selftest_timeout_s,
                                   use_cache=not args.no_cache, extra_args=extra)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if proof.report is None:
        print(f"edge-agent: {proof.error}", file=sys.stderr)
        return EXIT_ERROR
    doc = proof.report
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_selftest(doc))
        print(f"report: {state / 'selftest' / 'report.json'}")
    for w in doc.get("warnings") or []:
        print(f"edge-agent: warning: {w}", file=sys.stderr)
    if not proof.passed:
        print(f"edge-agent: {proof.reason}", file=sys.stderr)
        return EXIT_NOT_SELECTED
    return EXIT_OK


INTERRUPT_GRACE_S = 3.0


def _interrupted(signum: int, frame: Any) -> None:
    """SIGINT during `selftest`: say so, then unwind. A KeyboardInterrupt that lands inside a fork hook (logging's,
    while the child is being started) is swallowed there and the wait goes on: a timer ends the process then."""
    os.write(2, b"edge-agent: selftest interrupted (Ctrl-C): no verdict, nothing cached; run it again to prove "
                b"the bundle\n")  # os.write: safe inside a handler, whatever the main thread was printing
    import threading

    timer = threading.Timer(INTERRUPT_GRACE_S, os._exit, args=(EXIT_INTERRUPTED,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _task_metric(q: dict | None) -> str:
    """The fidelity (or reproduction) task metric in a table cell: never only a cosine."""
    if not q:
        return "-"
    m = q.get("metrics") or {}
    if "top1_agreement" in m:
        n, flips = int(m.get("top1_counted") or 0), int(m.get("top1_flips") or 0)
        return f"top1 {n - flips}/{n} [{m['top1_wilson_low']:.2f},{m['top1_wilson_high']:.2f}]"
    if "recall" in m:
        return f"R {m['recall']:.2f} P {m['precision']:.2f}"
    if "mask_iou" in m:
        return f"IoU {m['mask_iou']:.3f}"
    if m.get("min_channel_snr_db") is not None:
        return f"SNR {m['min_channel_snr_db']:.1f} dB"
    return "output fault" if q.get("findings") else "-"


def render_selftest(doc: dict) -> str:
    short = lambda p: p.replace("ExecutionProvider", "")  # noqa: E731
    lines = [f"self-test of {doc['bundle']['name']} v{doc['bundle']['version']} "
             f"({'cached verdict re-checked' if doc['cached'] else 'full'}, {doc['duration_ms']:.0f} ms)",
             f"{'candidate':20} {'runs on':10} {'reproduction':20} {'fidelity':26} {'p50/p95 ms':13} {'load':5} verdict"]
    for c in doc["candidates"]:
        rep, fid = c.get("reproduction"), c.get("fidelity")
        rep_s = "-" if not rep else f"{'ok' if rep['passed'] else 'FAIL'} vs {rep['against']}"
        if rep and rep.get("tolerance") and rep["tolerance"].get("abs_diff") is not None:
            rep_s += f" {rep['tolerance']['abs_diff']:.1e}"
        fid_s = "-" if not fid else f"{'ok' if fid['passed'] else 'LOW'} {_task_metric(fid)}"
        lat = c.get("latency")
        lat_s = f"{lat['p50_ms']:.2f}/{lat['p95_ms']:.2f}" if lat else "-"
        ctx = c.get("latency_context")
        load_s = f"{ctx['load_after']:.1f}" if ctx else "-"
        eff = ",".join(short(p) for p in c.get("effective_providers") or []) or "-"
        verdict = "PASS" if c["passed"] else ("-" if c["status"] == "not_tried" else "FAIL")
        if c["passed"] and c.get("warnings"):
            verdict = "PASS (warnings)"
        lines.append(f"{short(c['provider']) + ':' + c['variant']:20} {eff:10} {rep_s:20} {fid_s:26} {lat_s:13} "
                     f"{load_s:5} {verdict}")
        for r in c["reasons"]:
            lines.append(f"    {r}")
        for w in c.get("warnings") or []:
            lines.append(f"    warning: {w['text']}")
    for a in doc.get("latency_attempts") or []:
        p95 = ", ".join(f"{short(k)} {v:.2f}" for k, v in a["p95_ms"].items() if v is not None)
        lines.append(f"latency re-measured (attempt {a['attempt']}, after {a['waited_s']:g} s, load "
                     f"{a['load_average']}): p95 ms {p95}")
    dec = doc.get("decode")
    if dec:
        tried = ", ".join(f"1/{d['scale']} {'ok' if d['passed'] else 'FAIL'}" for d in dec.get("scales") or [])
        lines.append(f"reduced JPEG decode: max scale 1/{dec['max_scale']}" + (f" ({tried})" if tried else "")
                     + (f": {dec['reason']}" if dec.get("reason") else ""))
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    for w in doc.get("warnings") or []:
        lines.append(f"WARNING: {w}")
    for c in doc.get("crashes", []):
        lines.append(f"crashed: {c['reason']}")
    sel = doc["selected"]
    lines.append(f"selected: {short(sel['provider'])}:{sel['variant']}" + (" (DEGRADED)" if doc.get("degraded") else "")
                 if sel else f"selected: nothing: {doc['reason']}")
    return "\n".join(lines)


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.proof import spare
    from agent.service.malloc import cap_arenas

    cap_arenas()  # before any thread, and before the spare inherits the environment (agent/service/malloc.py)
    # the boot proof's child, started now: its imports run on another core while the agent imports its own
    spare.start(str(args.config) if args.config else "demo")
    try:
        # the config first (agent.config imports no numpy, OpenCV or onnxruntime): a typo's one line comes before the
        # agent's own imports, not after them (1.98 s before, measured)
        loaded = _load_cfg(args.config) if args.config else None
        from agent.service.daemon import Agent, demo_config

        cfg = loaded if loaded is not None else demo_config()
        _apply_log_config(args, cfg)
        if args.max_frames is not None:
            from dataclasses import replace

            cfg = replace(cfg, pipeline=replace(cfg.pipeline, max_frames=args.max_frames))
        return Agent(cfg).run()
    finally:
        spare.discard()


def _end_past_stuck_reads(code: int) -> None:
    """With a source's read still in flight after the agent stopped (a stuck camera), end the process now,
    flushed, without interpreter teardown, which would free what that read's thread still uses
    (agent.serving.sources.reads_in_flight); otherwise return, for the ordinary exit.

    The exit handlers still run first, as they do at an ordinary exit before any teardown (the serving
    ledger's markers and fault file go there: left behind, a clean stop read as a death at the next boot)."""
    import atexit

    from agent.logsetup import get_logger
    from agent.serving.sources import reads_in_flight

    left = reads_in_flight()
    if not left:
        return
    get_logger("agent").warning("agent.exit_past_stuck_reads", threads=left, exit_code=code,
                detail="a source is still inside a read: the process ends without interpreter teardown")
    atexit._run_exitfuncs()  # what Py_Finalize runs before its teardown, with every thread still alive
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


PLACEHOLDER = "@PREFIX@"


def _cmd_config_check(args: argparse.Namespace) -> int:
    """Parse, range-check, then every check `run` makes before serving (agent.service.preflight), without the
    self-test: the bundle loads, each file source opens, the state dir is writable, metrics can be served."""
    from agent.config import config_to_dict, masked, parse_config

    try:
        text = args.file.read_text()
    except OSError as exc:
        raise AgentError(f"{args.file}: cannot read config: {exc.strerror}") from exc
    template = PLACEHOLDER in text
    if template:
        # systemd/agent.yaml is the template install.sh fills in (sed s|@PREFIX@|$PREFIX|)
        text = text.replace(PLACEHOLDER, str(args.prefix or "/opt/edge-agent"))
    cfg = parse_config(text, str(args.file))
    notes = ([f"{PLACEHOLDER} placeholders read as {args.prefix or '/opt/edge-agent'} (install.sh's PREFIX; "
              "change with --prefix DIR)"] if template else [])
    from agent.service.preflight import check

    _quiet_opencv(True, "error")  # FFmpeg's own lines about a non-video would bury the one-line answer
    found = check(cfg, installed_here=not (template and not args.prefix))  # every check `run` makes first
    problems = found.problems
    notes += found.notes
    if problems:
        raise AgentError(f"{args.file}: cannot serve: " + "; ".join(problems))
    print(json.dumps(masked(config_to_dict(cfg)), indent=2))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"{args.file}: OK", file=sys.stderr)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge-agent", description="ONNX Runtime inference agent that proves its model on the device.")
    p.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    _global_options(p, top=True)
    sub = _Sub(p.add_subparsers(dest="command", required=True, metavar="COMMAND"))

    b = sub.add_parser("bundle", help="verify, inspect, pack, unpack and create model bundles")
    bsub = _Sub(b.add_subparsers(dest="bundle_command", required=True, metavar="ACTION"))
    v = bsub.add_parser("verify", help="check schema, hashes, contracts, golden samples (and the signature)")
    v.add_argument("path", type=Path, help="bundle directory or .tar.gz")
    v.add_argument("--pubkey", type=Path, action="append", default=[], help="trusted public key (repeatable)")
    v.set_defaults(func=_cmd_bundle_verify)
    kg = bsub.add_parser("keygen", help="make an Ed25519 signing key pair")
    kg.add_argument("--private", type=Path, required=True)
    kg.add_argument("--public", type=Path, required=True)
    kg.add_argument("--force", action="store_true", help="overwrite an existing key pair")
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
    c.add_argument("--full-range-weights", action="store_true",
                   help="quantise weights to 8 bits, not 7: only for a fleet whose CPUs all have VNNI (or ARM "
                        "dot-product); on AVX2 CPUs the fused int8 kernels saturate and answer differently")
    c.add_argument("--exclude-node", action="append", default=[], help="keep this node in float (repeatable)")
    c.add_argument("--exclude-op-type", action="append", default=[], help="keep nodes of this op type in float")
    c.add_argument("--exclude-node-pattern", action="append", default=[], metavar="REGEX",
                   help="keep nodes whose name matches this regular expression in float (repeatable)")
    c.add_argument("--exclude-after", action="append", default=[], metavar="NODE",
                   help="keep this node and everything downstream of it in float, e.g. a detector head (repeatable)")
    c.add_argument("--allow-preprocess-drift", type=float, metavar="MAX_ABS",
                   help="accept this max abs between the spec's preprocessing and the samples' 'input' tensors "
                        "(recorded in the manifest)")
    c.add_argument("--no-int8", action="store_true")
    c.add_argument("--fp16", action="store_true")
    c.add_argument("--calibration-limit", type=int, default=256)
    c.add_argument("--max-top1-drop", type=float, default=1.0, help="INT8 bound, held-out top-1 points under FP32")
    c.add_argument("--min-agreement", type=float, default=0.97, help="INT8 bound on agreement with FP32 without labels")
    c.add_argument("--keep-low-quality", action="store_true", help="keep an INT8 variant under the bound, marked")
    c.add_argument("--allow-unproven-decoder", action="store_true",
                   help="build a bundle that decodes boxes, masks or text although no answers.json (the package's "
                        "own results) proves its decoder; the warning is kept in the manifest (source.unproven_decoder)")
    c.add_argument("--pre-graph", type=Path, metavar="ONNX",
                   help="preprocess.graph: raw frame `frame` (uint8 HxWxC) -> the model input (+ `geometry`); copied "
                        "into the bundle, hashed and signed, never quantised")
    c.add_argument("--charset", type=Path, metavar="FILE",
                   help="postprocess.result.charset (kind text): one character per line, line i is token id i "
                        "(minus charset_offset); copied into the bundle, hashed and signed")
    c.add_argument("--post-graph", type=Path, metavar="ONNX",
                   help="postprocess.graph: model outputs (+ `frame_size`, `geometry`) -> the result tensors named in "
                        "the spec's postprocess.result; copied into the bundle, hashed and signed, never quantised")
    c.set_defaults(func=_cmd_bundle_create)
    from agent.bundle.graph_command import add_graph_parser  # `edge-agent bundle graph` (recipes: agent/bundle/graphs/)

    add_graph_parser(bsub)

    pr = sub.add_parser("providers", help="which execution providers really work on this device")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--config", type=Path)
    pr.set_defaults(func=_cmd_providers)

    s = sub.add_parser("selftest", help="prove a bundle on this device and select a candidate")
    s.add_argument("--bundle", type=Path, help="bundle directory or .tar.gz (required unless --forget-crashes)")
    s.add_argument("--forget-crashes", action="store_true", help="clear the crash records (crashed steps tried again)")
    s.add_argument("--forget-evidence", action="store_true", help="clear the evidence from serving (docs/proof.md)")
    s.add_argument("--config", type=Path)
    s.add_argument("--state-dir", type=Path, help="where the report, markers and cache go (default: config)")
    s.add_argument("--json", action="store_true", help="print the full JSON report")
    s.add_argument("--provider", help="pin a provider, e.g. CPUExecutionProvider")
    s.add_argument("--variant", help="pin a variant, e.g. int8")
    s.add_argument("--no-cache", action="store_true", help="ignore a cached verdict")
    s.add_argument("--latency-runs", type=int, help="override the bundle's latency run count")
    s.add_argument("--latency-retries", type=int, default=None,
                   help="latency re-measurements when only latency failed (config selection.latency_retries)")
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

    from agent.report.command import add_report_parser

    add_report_parser(sub)
    from agent.fleet.cli import add_fleet_parser  # `edge-agent fleet ...`: agent/fleet/cli.py

    add_fleet_parser(sub)

    cf = sub.add_parser("config", help="validate a config file")
    csub = _Sub(cf.add_subparsers(dest="config_command", required=True, metavar="ACTION"))
    cc = csub.add_parser("check", help="validate and print the effective settings")
    cc.add_argument("file", type=Path)
    cc.add_argument("--prefix", type=Path, help="what @PREFIX@ placeholders stand for (install.sh's --prefix; "
                                                   "default /opt/edge-agent)")
    cc.set_defaults(func=_cmd_config_check)
    return p


def _global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """On the program and on every command, so `edge-agent run --log-json` works like `edge-agent --log-json run`."""
    d = {} if top else {"default": argparse.SUPPRESS}
    g = p.add_argument_group("global options")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="default: the config's log.level, else info", **({"default": None} if top else d))
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--log-json", dest="log_json", action="store_const", const=True,
                     help="JSON log lines (default when stderr is not a terminal)", **({"default": None} if top else d))
    fmt.add_argument("--log-pretty", dest="log_json", action="store_const", const=False, help="readable log lines",
                     **({"default": None} if top else d))
    g.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error",
                   **({"default": False} if top else d))


class _Sub:
    """add_parser with the help text as the command's description, and the global options on every command."""

    def __init__(self, action: argparse._SubParsersAction):
        self.action = action

    def add_parser(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        kw.setdefault("description", kw.get("help"))
        sp = self.action.add_parser(name, **kw)
        _global_options(sp, top=False)
        return sp


def main(argv: Sequence[str] | None = None) -> int:
    from agent.logsetup import configure_logging

    args = build_parser().parse_args(argv)
    # Before anything imports onnxruntime: its telemetry prints a plain, coloured warning at import when $HOME is
    # unwritable (a service user), breaking one JSON object per line; a device sends no telemetry anyway.
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    configure_logging(args.log_level or "info", args.log_json)
    code = _run_command(args)
    if args.func is _cmd_run:  # however the agent ended: its error, if any, is printed by now
        _end_past_stuck_reads(code)
    return code


def _run_command(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except UsageError as exc:
        return _fail(args, exc, str(exc), EXIT_USAGE)
    except AgentError as exc:
        return _fail(args, exc, str(exc), EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `edge-agent ... | head`: the reader left; say nothing, and keep Python's exit flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        return _fail(args, exc, _explain_os_error(args, exc), EXIT_ERROR)
    except Exception as exc:  # a bug: one line, and the traceback with --debug
        return _fail(args, exc, f"internal error: {type(exc).__name__}: {exc} (run again with --debug for the "
                                "traceback, and report it)", EXIT_ERROR)


def _fail(args: argparse.Namespace, exc: BaseException, line: str, code: int) -> int:
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    print(f"edge-agent: {line.splitlines()[0] if line else type(exc).__name__}", file=sys.stderr)
    return code


def _explain_os_error(args: argparse.Namespace, exc: OSError) -> str:
    """What went wrong with which file or address, and what to do about it."""
    where = exc.filename or ""
    what = exc.strerror or str(exc)
    if isinstance(exc, (ConnectionRefusedError, ConnectionResetError)) or exc.errno in (
            errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT):
        broker = getattr(args, "broker", None)
        return (f"cannot reach the broker{' ' + broker if broker else ''}: {what}; is it running and listening "
                "there? (--broker HOST:PORT)")
    if isinstance(exc, PermissionError):
        hint = ("pass --state-dir DIR (or set state_dir in the config) to a directory you can write"
                if "edge-agent" in str(where) else "check the path's owner and mode")
        return f"{where}: permission denied; {hint}"
    if isinstance(exc, FileNotFoundError):
        return f"{where}: no such file or directory; check the path"
    if isinstance(exc, IsADirectoryError):
        return f"{where}: is a directory; give a file"
    return f"{where + ': ' if where else ''}{what}"
