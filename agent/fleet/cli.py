"""`edge-agent fleet ...`: ls, rollout plan|start|status|pause|resume|approve|abort, rollback, simulate.

Registered by agent/service/cli.py with one hook (`add_fleet_parser`); everything else lives here.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError
from agent.link.topics import ROOT

# Every `edge-agent` command builds this parser: the fleet's modules (paho, the operator) load only
# when a fleet command runs.
if TYPE_CHECKING:
    from agent.fleet.devices import DeviceCache
    from agent.fleet.operator import Operator
    from agent.fleet.plan import Artifact
    from agent.fleet.state import Connection, FleetClient

EXIT_OK, EXIT_FAILED = 0, 1


def _conn(args: argparse.Namespace) -> Connection:
    from agent.fleet.state import Connection, SyncPolicy, parse_broker

    host, port = parse_broker(args.broker)
    pw = Path(args.password_file).read_text().strip() if getattr(args, "password_file", None) else None
    return Connection(host, port, args.tls_ca, args.username, pw, args.root,
                      SyncPolicy(quiet_s=args.sync_quiet, base_s=args.sync_timeout, per_doc_s=args.sync_per_doc),
                      protocol=args.mqtt_protocol)


def _where(args: argparse.Namespace) -> list[tuple[str, str]]:
    from agent.fleet.facts import parse_where

    try:
        return parse_where(args.where or [])
    except ValueError as exc:
        raise AgentError(str(exc)) from exc


def _fleet_view(conn: Connection) -> DeviceCache:
    from agent.fleet.devices import DeviceCache
    from agent.fleet.state import FleetClient

    cache = DeviceCache(conn.device_root)
    client = FleetClient(conn).start(cache.topics())
    try:
        for topic, payload, _ in client.sync():
            from agent.fleet.state import decode

            cache.take(topic, decode(payload))
    finally:
        client.stop()
    return cache


def _cmd_ls(args: argparse.Namespace) -> int:
    rows = [r for r in _fleet_view(_conn(args)).rows().values() if r.matches(_where(args))]
    out = [r.row() for r in sorted(rows, key=lambda r: r.device)]
    if args.json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    cols = ("device", "availability", "labels", "provider", "committed", "current", "fidelity_margin", "p95_ms",
            "budget_ms", "last_failure")
    cells = [[str(r[c] if r[c] is not None else "-")[:48] for c in cols] for r in out]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print(f"{len(out)} devices", file=sys.stderr)
    return EXIT_OK


def _earlier_rejections(client_conn: Connection, artifact: Artifact) -> dict[str, str]:
    """Devices whose self-test rejected this same bundle (sha) in an earlier rollout, and the provider.

    Read from each rollout's small `rejections` index, not from every record of every rollout (each
    start read more); only a rollout of the same archive without an index (run before 7 December 2026)
    has its device records read."""
    from agent.fleet.state import FleetClient, RolloutTopics, decode

    plans: dict[str, str] = {}
    index: dict[str, dict[str, Any]] = {}
    client = FleetClient(client_conn).start(["fleet/rollout/+/plan", "fleet/rollout/+/rejections"])
    try:
        for topic, payload, _ in client.sync():
            parts = topic.split("/")
            doc = decode(payload)
            if not isinstance(doc, dict) or len(parts) != 4:
                continue
            if parts[3] == "plan":
                plans[parts[2]] = str((doc.get("artifact") or {}).get("sha256"))
            elif parts[3] == "rejections" and isinstance(doc.get("rejected_selftest"), dict):
                index[parts[2]] = doc["rejected_selftest"]
    finally:
        client.stop()
    same = [rid for rid, sha in sorted(plans.items()) if sha == artifact.sha256]
    out = {d: str(p) for rid in same if rid in index for d, p in index[rid].items()}
    legacy = [RolloutTopics(rid).base + "device/+" for rid in same if rid not in index]
    if legacy:
        client = FleetClient(client_conn).start(legacy)
        try:
            for topic, payload, _ in client.sync():
                doc = decode(payload)
                if isinstance(doc, dict) and doc.get("kind") == "rejected_selftest":
                    out[topic.rsplit("/", 1)[1]] = str(doc.get("provider"))
        finally:
            client.stop()
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from agent.fleet.facts import parse_where
    from agent.fleet.plan import (
        Artifact,
        Gates,
        Plan,
        phase_ends,
        select_targets,
        start_order,
    )
    from agent.hashing import sha256_file
    from agent.link.push import _manifest_summary

    conn = _conn(args)
    summary = _manifest_summary(args.bundle)
    if not summary:
        raise AgentError(f"{args.bundle}: cannot read its manifest; give a bundle .tar.gz made by `bundle pack`")
    artifact = Artifact(args.url, sha256_file(args.bundle), summary["name"], int(summary["version"]))
    rows = _fleet_view(conn).rows()
    where = _where(args)
    targets, skipped = select_targets(rows, where, artifact, _earlier_rejections(conn, artifact))
    rid = args.id or f"{artifact.name}-v{artifact.version}-{uuid.uuid4().hex[:6]}"
    prefer = parse_where(args.canary_prefer or [])
    order = start_order(rid, targets, prefer, rows)
    steps = [float(x) for x in args.steps.split(",")] if args.steps else None
    phases = phase_ends(len(order), args.canary, steps, args.ramp)
    gates = Gates(abort_failure_pct=args.abort_pct, abort_min_finished=args.abort_min,
                  min_committed_pct=args.min_committed_pct, min_fidelity_margin_p10=args.min_fidelity_margin,
                  max_latency_ratio_p95=args.max_latency_ratio, max_accelerator_fallbacks=args.max_fallbacks)
    plan = Plan(id=rid, artifact=artifact, targets=tuple(order), phases=phases, rate_per_min=args.rate,
                max_downloads=args.max_downloads, device_timeout_s=args.device_timeout, soak_s=args.soak,
                human_gate=args.human_gate, gates=gates, where=tuple(where),
                previous={d: rows[d].facts.get("accelerator") for d in order if rows[d].facts.get("accelerator")})
    if not order:
        raise AgentError(f"no device matches {where or 'the fleet'} and needs {artifact.name} v{artifact.version} "
                         f"({len(rows)} devices seen, {len(skipped)} skipped)")
    doc = plan.to_dict()
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    print(f"rollout {rid}: {len(order)} devices in phases {list(phases)}; {len(skipped)} skipped"
          + "".join(f"\n  skipped {d}: {why}" for d, why in list(skipped.items())[:20]), file=sys.stderr)
    return EXIT_OK


def _operator(args: argparse.Namespace, rid: str) -> tuple[Operator, FleetClient]:
    from agent.fleet.operator import Operator
    from agent.fleet.state import FleetClient

    conn = _conn(args)
    # its own session (a client id of its own, kept by the broker for 10 min): reconnects keep what it had
    op = Operator(FleetClient(conn, f"fleet-op-{rid}-{uuid.uuid4().hex[:6]}"[:60], session_s=600), rid, conn.device_root)
    op.client.start(op.topics())
    op.load()
    return op, op.client


def _run(op: Operator, args: argparse.Namespace) -> int:
    from agent.fleet.rollout_records import status_table

    try:
        state = op.run(max_s=args.max_s)
    finally:
        op.client.stop()
    print(status_table(state, op.records), file=sys.stderr)
    return EXIT_OK if state.get("status") == "done" else EXIT_FAILED


def _cmd_start(args: argparse.Namespace) -> int:
    from agent.errors import RolloutError
    from agent.fleet.plan import Plan
    from dataclasses import replace

    from agent.fleet.state import FleetClient, RolloutTopics

    # the time it is published binds every control request to this rollout (not to an earlier one, or a
    # typo, under the same id)
    plan = replace(Plan.from_dict(json.loads(args.plan.read_text())), published=round(time.time(), 3))
    conn = _conn(args)
    client = FleetClient(conn).start([RolloutTopics(plan.id).plan])
    try:
        existing = [t for t, p, _ in client.sync() if p]
        if existing:
            raise RolloutError(f"rollout {plan.id} already exists on the broker: `fleet rollout resume {plan.id}` "
                               "continues it; a new plan needs a new id")
        client.publish(RolloutTopics(plan.id).plan, plan.to_dict())
    finally:
        client.stop()
    if args.detach:
        print(f"rollout {plan.id} published; run it with `edge-agent fleet rollout resume {plan.id}`", file=sys.stderr)
        return EXIT_OK
    op, _ = _operator(args, plan.id)
    return _run(op, args)


def _cmd_resume(args: argparse.Namespace) -> int:
    from agent.errors import RolloutError

    op, _ = _operator(args, args.id)
    if op.state.get("status") == "paused":
        op.control = _control(args, "resume")
    try:
        op.take_over(force=args.force)
    except RolloutError:
        op.client.stop()
        raise
    return _run(op, args)


def _who() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return f"uid{os.getuid()}@{socket.gethostname()}"


def _control(args: argparse.Namespace, action: str, **detail: Any) -> dict[str, Any]:
    """Publish `action` bound to rollout `args.id` as it is on the broker; an id with no plan there is a usage
    error (exit 2) and leaves nothing retained: a stale request would stop a later rollout under that id."""
    from agent.errors import UsageError
    from agent.fleet.plan import Plan
    from agent.fleet.state import FleetClient, RolloutTopics, control_request, decode

    t = RolloutTopics(args.id)
    client = FleetClient(_conn(args)).start([t.plan])
    try:
        docs = [decode(p) for topic, p, _ in client.sync() if topic == t.plan and p]
        if not docs or not isinstance(docs[-1], dict):
            raise UsageError(f"no rollout {args.id!r} on the broker ({t.plan} is empty): nothing sent; "
                             "`edge-agent fleet rollout status ID` shows a rollout, `fleet ls` the fleet")
        req = control_request(args.id, Plan.from_dict(docs[-1]).published, action, _who(), **detail)
        client.publish(t.control, req)
    finally:
        client.stop()
    return req


def _cmd_control(args: argparse.Namespace) -> int:
    _control(args, args.action)
    print(f"{args.action} sent to rollout {args.id}; the running operator records the decision "
          f"(`fleet rollout status {args.id}`)", file=sys.stderr)
    return EXIT_OK


def _cmd_set_url(args: argparse.Namespace) -> int:
    from agent.errors import UsageError

    if not args.url.startswith(("http://", "https://")):
        raise UsageError(f"set-url {args.url!r}: expected an http(s):// URL to the same archive")
    _control(args, "set_url", url=args.url)
    print(f"{args.action} sent to rollout {args.id}; the running operator records the decision "
          f"(`fleet rollout status {args.id}`)", file=sys.stderr)
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    from agent.fleet.rollout_records import status_table

    while True:
        op, client = _operator(args, args.id)
        client.stop()
        if args.json:
            print(json.dumps({"state": op.state, "devices": op.records}, indent=1))
        else:
            print(status_table(op.state, op.records))
        if not args.watch:
            return EXIT_OK
        time.sleep(2.0)


def _cmd_rollback(args: argparse.Namespace) -> int:
    from agent.fleet.rollback import FleetRollback, RollbackCaps
    from agent.fleet.rollout_records import status_table

    op, client = _operator(args, args.id)
    try:
        op.take_over(force=args.force)
        plan = op.plan
        assert plan is not None  # _operator refused a rollout without one
        caps = RollbackCaps(
            args.rate if args.rate is not None else plan.rate_per_min,
            args.max_in_flight if args.max_in_flight is not None else plan.max_downloads,
            args.abort_pct if args.abort_pct is not None else plan.gates.abort_failure_pct,
            args.abort_min if args.abort_min is not None else plan.gates.abort_min_finished)
        state = FleetRollback(op, caps).run(max_s=args.max_s)
    finally:
        client.stop()
    print(status_table(state, op.records), file=sys.stderr)
    last = (state.get("decisions") or [{}])[-1]
    return EXIT_OK if last.get("failed") == 0 and not last.get("not_started") else EXIT_FAILED


def _cmd_compact(args: argparse.Namespace) -> int:
    from agent.fleet.rollout_records import compact

    op, client = _operator(args, args.id)
    try:
        op.take_over(force=args.force)
        n = compact(op)
    finally:
        client.stop()
    print(f"rollout {args.id}: {n} device records removed; its plan, state and rejections index stay", file=sys.stderr)
    return EXIT_OK


def _cmd_simulate(args: argparse.Namespace) -> int:
    import signal
    import tempfile

    from agent.fleet.sim_fleet import SimFleet
    from agent.fleet.sim_groups import load_groups, split_devices
    from agent.fleet.state import parse_broker

    groups = load_groups(args.groups)
    if args.devices:
        groups = split_devices(args.devices, groups)
    host, port = parse_broker(args.broker)
    root = args.state_root or Path(tempfile.mkdtemp(prefix="edge-sim-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    fleet = SimFleet(host, port, groups, args.seed_bundle, args.trusted_key, root, seed=args.seed,
                     root=args.root, workers=args.workers, protocol=args.mqtt_protocol)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    t0 = time.monotonic()
    fleet.start()
    print(json.dumps({"event": "sim.ready", "devices": len(fleet.devices), "state_root": str(root),
                      "connect_s": round(time.monotonic() - t0, 2)}), flush=True)
    try:
        end = None if args.max_s is None else time.monotonic() + args.max_s
        while not stop["now"] and (end is None or time.monotonic() < end):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        summary = fleet.summary()
        fleet.close()
        if args.summary:
            args.summary.write_text(json.dumps(summary))
        if not args.state_root:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    return EXIT_OK


def _protocol_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mqtt-protocol", choices=("5", "3.1.1"), default="5",
                   help="MQTT version spoken to the broker: 5, or 3.1.1 for brokers without MQTT 5 (aedes); "
                        "the operator's session then is clean_session=false instead of a session expiry")


def _broker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", default="127.0.0.1:1883", help="HOST[:PORT]")
    p.add_argument("--root", default=ROOT, help="topic root above the device ids")
    p.add_argument("--tls-ca")
    _protocol_arg(p)
    p.add_argument("--username")
    p.add_argument("--password-file")
    p.add_argument("--sync-quiet", type=float, default=2.0, metavar="S",
                   help="reading the retained fleet is complete after no retained document arrived for this long "
                        "(at least; longer when the broker delivers slowly)")
    p.add_argument("--sync-timeout", type=float, default=30.0, metavar="S",
                   help="bound on reading the retained fleet: this many seconds ...")
    p.add_argument("--sync-per-doc", type=float, default=0.05, metavar="S", help="... plus this much per document read")


def add_fleet_parser(sub: Any) -> None:
    """The hook agent/service/cli.py calls: `sub` is its subcommand registrar."""
    f = sub.add_parser("fleet", help="phased rollouts to many devices, gated by what the devices proved")
    fsub = f.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")

    ls = fsub.add_parser("ls", help="the fleet table from retained facts and availability")
    _broker_args(ls)
    ls.add_argument("--where", action="append", metavar="KEY=VALUE",
                    help="filter (repeatable): provider, effective, accelerator, agent, onnxruntime, bundle, version, "
                         "availability, device, or a config label (site, group, camera)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_ls)

    ro = fsub.add_parser("rollout", help="plan, start, watch and steer a phased rollout")
    rsub = ro.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    pl = rsub.add_parser("plan", help="targets and phases for a bundle, as a plan file")
    _broker_args(pl)
    pl.add_argument("--bundle", type=Path, required=True, help="the bundle .tar.gz (its name, version and sha256)")
    pl.add_argument("--url", required=True, help="where devices fetch it (one HTTP server or object store)")
    pl.add_argument("--where", action="append", metavar="KEY=VALUE")
    pl.add_argument("--id", help="rollout id (default <name>-v<version>-<random>)")
    pl.add_argument("--canary", default="1%", help="first phase: a count or N%% of the targets")
    pl.add_argument("--canary-prefer", action="append", metavar="KEY=VALUE", help="devices the canary takes first")
    g = pl.add_mutually_exclusive_group()
    g.add_argument("--steps", default="10,50", help="cumulative %% of targets per later phase (the last is 100)")
    g.add_argument("--ramp", type=float, help="exponential: each phase this many times the previous")
    pl.add_argument("--rate", type=float, default=60.0, help="devices started per minute, at most")
    pl.add_argument("--max-downloads", type=int, default=50, help="devices downloading at once, fleet-wide")
    pl.add_argument("--device-timeout", type=float, default=900.0, help="s: download + self-test + probation")
    pl.add_argument("--soak", type=float, default=0.0, help="s after a phase before its gate is judged")
    pl.add_argument("--human-gate", action="store_true", help="wait for `fleet rollout approve` between phases")
    pl.add_argument("--abort-pct", type=float, default=20.0)
    pl.add_argument("--abort-min", type=int, default=10)
    pl.add_argument("--min-committed-pct", type=float, default=80.0)
    pl.add_argument("--min-fidelity-margin", type=float, default=0.0, help="bound on p10 of (fidelity - floor)")
    pl.add_argument("--max-latency-ratio", type=float, default=1.0, help="bound on p95 of (self-test p95 / budget)")
    pl.add_argument("--max-fallbacks", type=int, default=0, help="devices allowed to fall from an accelerator to CPU")
    pl.add_argument("--out", type=Path, help="write the plan here (default stdout)")
    pl.set_defaults(func=_cmd_plan)

    st = rsub.add_parser("start", help="publish the plan and run it (until done, aborted or --max-s)")
    _broker_args(st)
    st.add_argument("plan", type=Path)
    st.add_argument("--detach", action="store_true", help="only publish the plan")
    st.add_argument("--max-s", type=float)
    st.set_defaults(func=_cmd_start)
    rs = rsub.add_parser("resume", help="continue a rollout from its retained state (after a pause, or its operator died)")
    _broker_args(rs)
    rs.add_argument("id")
    rs.add_argument("--force", action="store_true", help="take over although another operator's heartbeat is fresh")
    rs.add_argument("--max-s", type=float)
    rs.set_defaults(func=_cmd_resume)
    ss = rsub.add_parser("status", help="the rollout's state, counts, gate and latest decisions")
    _broker_args(ss)
    ss.add_argument("id")
    ss.add_argument("--json", action="store_true")
    ss.add_argument("--watch", action="store_true", help="print again every 2 s (a live table)")
    ss.set_defaults(func=_cmd_status)
    for action, hlp in (("pause", "stop starting devices (in-flight ones finish)"),
                        ("approve", "pass the human gate (or override a held gate) to the next phase"),
                        ("abort", "stop the rollout for good; then `fleet rollback` if wanted")):
        c = rsub.add_parser(action, help=hlp)
        _broker_args(c)
        c.add_argument("id")
        c.set_defaults(func=_cmd_control, action=action)
    cp = rsub.add_parser("compact", help="remove a finished rollout's device records (its plan, state and rejections stay)")
    _broker_args(cp)
    cp.add_argument("id")
    cp.add_argument("--force", action="store_true")
    cp.set_defaults(func=_cmd_compact)
    su = rsub.add_parser("set-url", help="a fresh URL for the same archive (a signed URL expired); later commands use it")
    _broker_args(su)
    su.add_argument("id")
    su.add_argument("url")
    su.set_defaults(func=_cmd_set_url, action="set_url")

    rb = fsub.add_parser("rollback", help="devices the rollout committed go back to their previous bundle (no download)")
    _broker_args(rb)
    rb.add_argument("id")
    rb.add_argument("--force", action="store_true")
    rb.add_argument("--rate", type=float, help="devices sent back per minute, at most (default: the plan's --rate)")
    rb.add_argument("--max-in-flight", type=int, help="rollbacks running at once (default: the plan's --max-downloads)")
    rb.add_argument("--abort-pct", type=float, help="stop sending devices back when failed / finished reaches this "
                                                   "(default: the plan's)")
    rb.add_argument("--abort-min", type=int, help="... once at least this many finished (default: the plan's)")
    rb.add_argument("--max-s", type=float)
    rb.set_defaults(func=_cmd_rollback)

    sm = fsub.add_parser("simulate", help="N simulated devices on the agent's topics and update code")
    _broker_args(sm)
    sm.add_argument("--devices", type=int, help="total devices, split over the groups by their counts")
    sm.add_argument("--groups", default="sim:1", help="YAML/JSON file, or 'a:50;b:50:reject_pct=30'")
    sm.add_argument("--seed-bundle", type=Path, required=True, help="the bundle every device starts with (committed)")
    sm.add_argument("--trusted-key", type=Path, action="append", default=[], help="public key for pushed bundles")
    sm.add_argument("--state-root", type=Path, help="device stores (default a fresh dir under /dev/shm, removed)")
    sm.add_argument("--seed", type=int, default=1)
    sm.add_argument("--workers", type=int, default=64)
    sm.add_argument("--max-s", type=float)
    sm.add_argument("--summary", type=Path, help="write per-device command counts and bundles here at exit")
    sm.set_defaults(func=_cmd_simulate)
