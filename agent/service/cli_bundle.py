"""`edge-agent bundle ...`: verify, keygen, sign, list, activate, inspect, pack, unpack, create; each handler
imports what it needs when it runs, so the help stays fast."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from agent.errors import AgentError, UsageError

EXIT_OK, EXIT_ERROR = 0, 1  # as agent.service.cli says them


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

    existing = [str(p) for p in (args.private, args.public) if p.exists()]
    if existing and not args.force:
        raise UsageError(f"{', '.join(existing)} already exists: replacing a signing key strands every device that "
                         "trusts it; pass --force to overwrite, or choose other paths")
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
    cfg = _load_cfg(args.config)
    where = (args.state_dir or cfg.state_dir) / "store"
    if not where.is_dir():  # a mistyped --state-dir must not leave an empty store behind
        print(f"edge-agent: no bundles in the store {where / 'bundles'}: there is no store there (the agent makes "
              "one at its first boot with updates.enabled; --state-dir or --config names another device state)",
              file=sys.stderr)
        return EXIT_OK
    store = _store(args)
    entries = store.entries()
    for e in entries:
        marks = ",".join(m for m, on in (("current", e.current), ("committed", e.committed)) if on)
        print(f"{e.id:56} {marks}")
    if not entries:  # said, not an empty screen: a wrong --state-dir or --config looks like an empty store
        print(f"edge-agent: no bundles in the store {store.bundles} (the agent seeds it from the config's bundle "
              "at its first boot with updates.enabled; `edge-agent push` adds one; --state-dir or --config "
              "names another device state)", file=sys.stderr)
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
    if bid != Path(bid).name or not store.path(bid).is_dir():  # an id in the store, never a path
        have = ", ".join(e.id for e in store.entries()) or "none"
        raise UsageError(f"no bundle {bid!r} in the store {store.bundles} (it holds: {have}); "
                         "`edge-agent bundle list` shows them")
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
        reduce_range=not args.full_range_weights,
        exclude_nodes=tuple(args.exclude_node), exclude_op_types=tuple(args.exclude_op_type),
        exclude_node_patterns=tuple(args.exclude_node_pattern), exclude_after=tuple(args.exclude_after),
        allow_preprocess_drift=args.allow_preprocess_drift,
        int8=not args.no_int8, fp16=args.fp16, calibration_limit=args.calibration_limit,
        max_top1_drop=args.max_top1_drop, min_agreement=args.min_agreement, keep_low_quality=args.keep_low_quality,
        pre_graph=args.pre_graph, post_graph=args.post_graph, charset=args.charset,
        allow_unproven_decoder=args.allow_unproven_decoder,
    ))
    print(f"created {out}")
    return EXIT_OK


def _load_cfg(path: Path | None) -> Any:
    """The config at `path`, or the defaults."""
    from agent.config import Config, load_config

    return load_config(path) if path else Config()
