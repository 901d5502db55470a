"""Updates: a pushed bundle is verified, self-tested on this device in a child process, switched in
atomically, watched on probation, then committed, or rolled back. The old bundle serves until then.

How a bundle arrives (MQTT chunks, a URL, an inbox) is agent.updates.delivery's job; every step is
logged and published on `update/status`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from agent import __version__
from agent.bundle.archive import UnpackLimits, unpack_signed
from agent.bundle.load import Bundle, load_bundle
from agent.config import UpdatesConfig
from agent.errors import AgentError
from agent.hashing import sha256_file
from agent.logsetup import get_logger
from agent.bundle.signing import verify_signature
from agent.updates.store import BundleStore
from agent.proof.verdict import Candidate

log = get_logger("updates")


class UpdateRejected(AgentError):
    """An update was refused; the message is the reason published on update/status."""


class ServingAgent(Protocol):
    """What the updater needs from the daemon."""

    bundle: Bundle | None

    def swap_bundle(self, bundle: Bundle, candidate: Candidate, report: dict[str, Any]) -> Any: ...
    def restore(self, previous: Any) -> None: ...
    def pipeline_metrics(self) -> Any: ...


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


class Updater:
    def __init__(self, agent: ServingAgent, store: BundleStore, cfg: UpdatesConfig, state_dir: Path,
                 config_file: Path | None, publish: Callable[[dict[str, Any]], None]):
        self.agent, self.store, self.cfg = agent, store, cfg
        self.state_dir, self.config_file, self.publish = state_dir, config_file, publish
        self.lock = threading.Lock()  # one update at a time
        if cfg.allow_unsigned:
            log.warning("updates.unsigned_allowed", detail="UNSIGNED BUNDLES ARE ACCEPTED (updates.allow_unsigned)")

    # -- status ------------------------------------------------------------------------------------------
    def status(self, update: str, origin: str, state: str, **detail: Any) -> dict[str, Any]:
        doc = {"update": update, "origin": origin, "state": state, "ts": round(time.time(), 3), **detail}
        (log.warning if state in ("rejected", "rolled_back") else log.info)("update." + state, update=update, **detail)
        self.publish(doc)
        return doc

    # -- the install flow --------------------------------------------------------------------------------
    def install(self, archive: Path, origin: str, update: str, expected_sha256: str | None = None) -> dict[str, Any]:
        with self.lock:
            work = self.store.new_staging("update-")
            try:
                return self._install(archive, origin, update, expected_sha256, work)
            except UpdateRejected as exc:
                return self.status(update, origin, "rejected", reason=str(exc))
            except AgentError as exc:  # bundle, archive, signature errors all name the problem
                return self.status(update, origin, "rejected", reason=str(exc))
            finally:
                shutil.rmtree(work, ignore_errors=True)

    def _install(self, archive: Path, origin: str, update: str, expected_sha256: str | None,
                 work: Path) -> dict[str, Any]:
        self.status(update, origin, "verifying")
        size = archive.stat().st_size
        if size > self.cfg.max_bundle_bytes:
            raise UpdateRejected(f"archive is {size} bytes, over updates.max_bundle_bytes {self.cfg.max_bundle_bytes}")
        if expected_sha256 is not None:
            actual = sha256_file(archive)
            if actual != expected_sha256:
                raise UpdateRejected(f"hash mismatch: archive sha256 {actual[:16]}..., expected {expected_sha256[:16]}...")
        self.status(update, origin, "unpacking")
        # signature first: nothing is written before bundle.yaml verifies; each member is hashed as it lands
        root, sig = unpack_signed(archive, work / "bundle", UnpackLimits(max_member_bytes=self.cfg.max_bundle_bytes,
                                  max_total_bytes=self.cfg.max_bundle_bytes), self.cfg.trusted_keys, self.cfg.allow_unsigned)
        if not sig.signed:
            log.warning("update.unsigned_accepted", update=update, detail="no signature; allowed by config")
        bundle = load_bundle(root)
        self._check_version_and_compatibility(bundle)
        self.status(update, origin, "verified", bundle=bundle.identity, key_id=sig.key_id)

        return self._prove_and_switch(update, origin, root, bundle, stored_id=None)

    def rollback(self, update: str) -> dict[str, Any]:
        """Go back to the previous committed bundle: verified and self-tested again, then switched."""
        with self.lock:
            prev = self.store.previous_committed()
            if prev is None:
                return self.status(update, "rollback", "rejected", reason="no previous committed bundle in the store")
            try:
                root = self.store.path(prev)
                seeded = self.store.seed_sha256(prev)  # the operator's own seed needs no signature ...
                if seeded is None:
                    verify_signature(root, self.cfg.trusted_keys, self.cfg.allow_unsigned)
                bundle = load_bundle(root)
                if seeded is not None and bundle.manifest_sha256 != seeded:  # ... but must be what was installed
                    raise UpdateRejected(f"{root}: the seeded bundle changed on disk since it was installed")
                self.status(update, "rollback", "verified", bundle=bundle.identity)
                return self._prove_and_switch(update, "rollback", root, bundle, stored_id=prev)
            except AgentError as exc:
                return self.status(update, "rollback", "rejected", reason=str(exc))

    def _prove_and_switch(self, update: str, origin: str, root: Path, bundle: Bundle,
                          stored_id: str | None) -> dict[str, Any]:
        self.status(update, origin, "selftest")
        report = self._child_selftest(root)
        if not report.get("passed"):
            raise UpdateRejected(f"self-test failed on this device: {report.get('reason')}")
        wanted = set(bundle.manifest.requires.get("providers", []))
        usable = {p["name"] for p in report.get("providers", []) if p.get("usable")}
        if wanted and not wanted & usable:
            raise UpdateRejected(f"bundle requires one of {sorted(wanted)}; usable here: {sorted(usable)}")
        sel = report["selected"]
        candidate = Candidate(sel["provider"], sel["variant"], sel["precision"],
                              next((c["options"] for c in report["candidates"]
                                    if c["provider"] == sel["provider"] and c["variant"] == sel["variant"]), {}))
        self.status(update, origin, "selftest_passed", selected=f"{candidate.provider}:{candidate.variant}")

        bid = stored_id or self.store.add(root, bundle)
        # verified in staging and moved by rename: same files, new root; no second hashing pass
        stored = dataclasses.replace(bundle, root=self.store.path(bid))
        self.store.activate(bid)
        self.status(update, origin, "switched", bundle=bid)
        try:
            previous = self.agent.swap_bundle(stored, candidate, report)
        except AgentError as exc:
            self.store.revert_current()
            return self.status(update, origin, "rolled_back", reason=f"could not start serving it: {exc}")
        self.status(update, origin, "probation", seconds=self.cfg.probation_s, frames=self.cfg.probation_frames)
        ok, detail = self._probation(stored, candidate)
        if not ok:
            self.agent.restore(previous)
            self.store.revert_current()
            return self.status(update, origin, "rolled_back", reason=detail, bundle=bid)
        self.store.commit(bid)
        removed = self.store.prune(self.cfg.keep)
        return self.status(update, origin, "committed", bundle=bid, probation=detail, pruned=removed)

    def _check_version_and_compatibility(self, bundle: Bundle) -> None:
        """Anti-downgrade (only `rollback` goes back, and it does not come through here) and requires.agent."""
        active = self.agent.bundle
        m = bundle.manifest
        if active is not None:
            a = active.manifest
            if m.name == a.name and m.version <= a.version:
                raise UpdateRejected(f"version {m.version} is not newer than the active {a.name} version {a.version} "
                                     "(anti-downgrade; use the rollback command to go back)")
        need = m.requires.get("agent")
        if need and _version_tuple(__version__) < _version_tuple(need):
            raise UpdateRejected(f"bundle requires agent >= {need}, this agent is {__version__}")

    def _child_selftest(self, root: Path) -> dict[str, Any]:
        """The same self-test as boot, in a child process: a crashing provider cannot kill the agent."""
        cmd = [sys.executable, "-m", "agent", "--log-level", "warning", "selftest", "--bundle", str(root),
               "--state-dir", str(self.state_dir / "update-selftest"), "--json", "--no-cache"]
        if self.config_file is not None:
            cmd += ["--config", str(self.config_file)]
        wrapper = os.environ.get("EDGE_AGENT_SELFTEST_WRAPPER")
        if wrapper:  # e.g. "nice -n 10" or "systemd-run --scope ..."; tests use it to crash the child
            cmd = wrapper.split() + cmd
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.cfg.selftest_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise UpdateRejected(f"self-test timed out after {self.cfg.selftest_timeout_s:g} s") from exc
        if out.returncode < 0:
            raise UpdateRejected(f"self-test process crashed (signal {-out.returncode}); the agent kept serving")
        if out.returncode not in (0, 3):
            tail = " ".join(out.stderr.strip().splitlines()[-2:])[:300]
            raise UpdateRejected(f"self-test process failed (exit {out.returncode}): {tail}")
        try:
            return json.loads(out.stdout)
        except ValueError as exc:
            raise UpdateRejected(f"self-test process printed no report: {exc}") from exc

    def _probation(self, bundle: Bundle, candidate: Candidate) -> tuple[bool, str]:
        """N seconds or frames on the new bundle: no inference errors, inference p95 within budget."""
        m = self.agent.pipeline_metrics()
        if m is None:
            return True, "not serving frames: committed after the self-test alone"
        base_out, base_err = m.frames_out, m.inference_errors
        deadline = time.monotonic() + self.cfg.probation_s
        while time.monotonic() < deadline and m.frames_out - base_out < self.cfg.probation_frames:
            if m.inference_errors > base_err:
                return False, f"probation: {m.inference_errors - base_err} inference errors on the new bundle"
            time.sleep(0.05)
        if m.inference_errors > base_err:
            return False, f"probation: {m.inference_errors - base_err} inference errors on the new bundle"
        served = m.frames_out - base_out
        if served == 0:
            return True, f"no frames in {self.cfg.probation_s:g} s of probation"
        samples = list(m.latency_ms["inference"])[-served:]
        budget = bundle.manifest.selftest.budget_for(candidate.provider)
        p95 = float(np.percentile(samples, 95)) if samples else 0.0
        if budget is not None and p95 > budget:
            return False, f"probation: inference p95 = {p95:.2f} ms over budget {budget:g} ms"
        return True, f"{served} frames, inference p95 {p95:.2f} ms, no errors"
