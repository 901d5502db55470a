"""`edge-agent report`: the self-test report page from a report.json, a state directory or a broker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from agent.errors import AgentError, UsageError, install_hint


def _load(spec: str | None, args: argparse.Namespace, what: str,
          with_health: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The report, and (from the broker, when asked) the device's retained health message."""
    from agent.report.sources import fetch_device, load_report

    if spec:
        return load_report(Path(spec)), None
    if args.broker and args.device:
        host, _, port = args.broker.partition(":")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise UsageError(f"--broker: expected HOST[:PORT] with a port of 1-65535, found {args.broker!r}")
        password = Path(args.password_file).read_text().strip() if args.password_file else None
        doc, health = fetch_device(host, int(port or (8883 if args.tls_ca else 1883)), args.device, args.prefix,
                                   args.wait, args.username, password, args.tls_ca)
        return doc, health if with_health else None
    raise UsageError(f"{what}: give a report.json or state directory, or --broker HOST[:PORT] --device ID")


def run_report(args: argparse.Namespace) -> int:
    try:
        import jinja2  # noqa: F401 - the page is a Jinja2 template
    except ImportError as exc:
        raise AgentError("edge-agent report renders its page with Jinja2, which is not installed: "
                         + install_hint("report", "jinja2")) from exc
    from agent.report.page import render_report, write_report
    from agent.report.sources import load_health

    for flag, path in (("--bundle", args.bundle), ("--compare-bundle", args.compare_bundle)):
        if path is not None and not path.is_dir():  # asked for thumbnails and bounds: never silently without
            raise UsageError(f"{flag}: {path} is not a bundle directory")
    if args.health is not None and not args.health.is_file():
        raise UsageError(f"--health: {args.health} is not a file (a saved health message or `status` reply)")
    doc, health = _load(args.source, args, "edge-agent report", with_health=True)
    if args.health is not None:
        health = load_health(args.health)
    old = _load(args.compare, args, "--compare")[0] if args.compare else None
    page = render_report(doc, bundle_root=args.bundle, compare=old, compare_bundle_root=args.compare_bundle,
                         health=health)
    out = args.out or Path(f"selftest-{(doc.get('bundle') or {}).get('name', 'report')}-"
                           f"v{(doc.get('bundle') or {}).get('version', '')}.html")
    write_report(out, page)
    if args.open:
        print(out.resolve().as_uri())
    else:
        from agent.proof.overall import proof_verdict

        verdict = proof_verdict(doc).upper()  # DEGRADED, never PASS, for what serves too slow or below floor
        print(f"{verdict}: wrote {out} ({out.stat().st_size:,} bytes)")
    if not doc.get("passed"):
        print(f"edge-agent: the report's verdict: {doc.get('reason')}", file=sys.stderr)
    return 0


def add_report_parser(sub: Any) -> None:
    rp = sub.add_parser("report", help="the self-test report as one self-contained HTML page (plots, samples)")
    rp.add_argument("source", nargs="?", help="report.json or a state directory (or use --broker/--device)")
    rp.add_argument("--out", type=Path, help="HTML file to write (default: selftest-<bundle>-v<version>.html)")
    rp.add_argument("--bundle", type=Path, help="the bundle directory, for golden thumbnails and manifest bounds "
                                               "(default: the path the report names, when it exists here)")
    rp.add_argument("--compare", help="the report this one replaces (report.json or state dir): side by side")
    rp.add_argument("--compare-bundle", type=Path, help="the bundle directory of --compare")
    rp.add_argument("--health", type=Path, help="a saved health message (or `status` reply): the serving audit "
                                               "and re-proof schedule (with --broker: read from the broker)")
    rp.add_argument("--broker", help="HOST[:PORT]: read the device's retained selftest (and health) topics")
    rp.add_argument("--device", help="device id (with --broker)")
    rp.add_argument("--prefix", help="topic prefix (default edge/<device>/)")
    rp.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the retained report")
    rp.add_argument("--tls-ca")
    rp.add_argument("--username")
    rp.add_argument("--password-file")
    rp.add_argument("--open", action="store_true", help="print only the page's file:// URI (to open it)")
    rp.set_defaults(func=run_report)
