"""Boot work: which bundle serves, proven in a child process, then the one proven session opened here.

Runs on the controller's thread at start and on a job thread for a reload; it returns a `BootOutcome`
and changes no state: the controller applies the outcome.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bundle.load import Bundle, load_bundle
from agent.config import Config
from agent.errors import AgentError
from agent.fsio import read_json, write_json_atomic
from agent.logsetup import get_logger
from agent.proof.crash_files import EVIDENCE_FILES, SERVED_FILE
from agent.proof.isolation import ChildProof, CrashLedger, prove_in_child
from agent.proof.verdict import Candidate
from agent.service.audit import AuditTap
from agent.service.serving_ledger import ServingWatch, noted_deaths, serving_faults, watch_faults
from agent.service.serving_ledger import recover as recover_serving_crashes
from agent.serving.engine import Engine, build_engine

log = get_logger("boot")


@dataclass(frozen=True)
class BootOutcome:
    bundle: Bundle | None
    engine: Engine | None
    report: dict[str, Any] | None  # the self-test report that proved (or refused) it
    reason: str | None             # why nothing serves; None when `engine` is ready
    # the bundle can never be proven as it stands (missing, not a bundle, a file that fails its hash): no re-proof
    # or reload of the same files changes that; only a new bundle does (the controller exits when none can come)
    unservable: bool = False
    refused: bool = False  # the config itself cannot serve (a source that cannot open): not even a new bundle helps


def serving_root(cfg: Config, store: Any) -> Path | None:
    """With updates: the store's committed bundle (seeded from `bundle` once); else `bundle` itself."""
    if store is None:
        return cfg.bundle
    bid = store.serving_id()
    if bid is None and cfg.bundle is not None:
        bid = store.import_bundle(cfg.bundle)
        log.info("store.seeded", bundle=bid, source=str(cfg.bundle))
    return store.path(bid) if bid is not None else None


def candidate_from_report(report: dict[str, Any]) -> Candidate:
    sel = report["selected"]
    options = next((c.get("options") or {} for c in report.get("candidates", [])
                    if c["provider"] == sel["provider"] and c["variant"] == sel["variant"]), {})
    return Candidate(sel["provider"], sel["variant"], sel["precision"], options)


def open_engine(bundle: Bundle, candidate: Candidate, cfg: Config) -> Engine:
    """The serving session of a proven candidate; it must run on the provider that was proven.

    A crash marker names the candidate while the session opens and through its first inferences
    (at boot and at every swap): a process that dies there costs this candidate at the next boot; each
    stage graph has its own marker, so a death inside one costs the stage."""
    faults = serving_faults(bundle.manifest.version)
    watch_faults(cfg.state_dir / "selftest")  # a native crash's thread, for the next boot's blame
    watch = ServingWatch(cfg.state_dir / "selftest", bundle.manifest_sha256, candidate.key, faults=faults)

    def stage_watch(stage: str) -> ServingWatch:
        # the bundle's pre/post graph: a death inside its session costs the stage ("stage:post"), which no
        # candidate can serve without, never the model candidate that was not running
        w = ServingWatch(cfg.state_dir / "selftest", bundle.manifest_sha256, candidate.key, faults=faults,
                         step=f"stage:{stage}", fault="stage")
        watch.stages.append(w)
        return w

    engine = build_engine(bundle, candidate, cfg.session, watch=watch, tap=AuditTap(), stage_watch=stage_watch)
    if candidate.provider not in engine.opened.effective:
        raise AgentError(f"the serving session for {candidate.key} runs on {list(engine.opened.effective)}, "
                         "not the proven provider")
    return engine


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def memory_dir(state_dir: Path) -> Path:
    """Where a state directory's work goes while its disk is full: one directory per state dir in memory
    (/dev/shm, else the temporary directory), the same at every start."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())) / f"edge-agent-{digest}"


def in_memory_state(cfg: Config, exc: OSError) -> tuple[Config, str]:
    """The config with its proof's state in memory, when the state disk is full: the proof's markers, skip list
    and report (and the serving markers) go to a directory under the temporary file system, seeded with the
    state disk's crash records and proof cache, so the device still proves and serves (the outbox holds its
    results in memory as it does when the disk fills later). The same directory at each start while the disk
    stays full: a crash recorded there is still skipped at the next start. Returns the config and what health
    says."""
    scratch = memory_dir(cfg.state_dir)
    (scratch / "selftest").mkdir(parents=True, exist_ok=True)
    for name in EVIDENCE_FILES:
        src = cfg.state_dir / "selftest" / name
        if src.exists() and not (scratch / "selftest" / name).exists():
            try:
                shutil.copyfile(src, scratch / "selftest" / name)
            except OSError:
                pass  # unreadable: the proof runs without it, as on a first boot
    said = (f"disk full: the state directory {cfg.state_dir} has no space ({exc.strerror}); proven and serving "
            f"from memory ({scratch}): crash records and the proof cache stay there until space returns")
    log.error("boot.state_disk_full", state_dir=str(cfg.state_dir), scratch=str(scratch), error=str(exc),
              reason="the proof runs with its state in memory; free the disk and restart to keep it on disk")
    return dataclasses.replace(cfg, state_dir=scratch), said


def prove(root: Path, cfg: Config, use_cache: bool = True, extra_args: tuple[str, ...] = ()) -> ChildProof:
    return prove_in_child(root, cfg.state_dir, cfg, cfg.updates.selftest_timeout_s, use_cache=use_cache,
                          extra_args=extra_args)


def bundle_path_problem(path: Path) -> str | None:
    """Why the config's `bundle` path cannot be a bundle directory, in one line (run and config check)."""
    if not path.exists():
        return f"{path} does not exist (set bundle: to a bundle directory)"
    if not path.is_dir():
        hint = " (unpack it with `edge-agent bundle unpack`)" if path.name.endswith((".tar.gz", ".tgz")) else ""
        return f"{path} is not a directory{hint}"
    return None


def bundle_unreadable(root: Path) -> str | None:
    """Why the bundle at `root` cannot be read at all (its manifest, a file's hash), or None. Asked only after a
    proof ended with no report; it parses the manifest and hashes the files (pure Python: no session, no native
    code a crash could hide in), which is all the agent itself does with them before a verdict anyway."""
    try:
        load_bundle(root, check_contracts=False, check_golden=False)
    except AgentError as exc:
        return str(exc)
    return None


def _no_report(root: Path, error: str | None, crashed: bool = False, refused: bool = False) -> BootOutcome:
    """A proof with no report: an unreadable bundle is said as `config check` says it (key bundle: ...). Never after
    a child died on the way (a crash, a signal, a time-out, a load recorded as killing a process): nothing of such a
    bundle is read in the agent's own process (tests/proof/test_boot_load_isolation.py)."""
    text = error or ""
    if crashed or text.startswith(("loading the bundle", "the child died")) or "SIG" in text or "timeout" in text:
        return BootOutcome(None, None, None, error)
    why = bundle_unreadable(root)
    if why is not None:
        return BootOutcome(None, None, None, f"key bundle: {why}", unservable=True)
    # the child refused it with the agent's own error: no re-proof of these files changes that (only a new bundle)
    return BootOutcome(None, None, None, error, unservable=refused)


def boot(cfg: Config, store: Any) -> BootOutcome:
    """Prove the serving bundle in a child and open its winner; any failure is a reason, never a raise."""
    try:
        root = serving_root(cfg, store)
    except AgentError as exc:
        return BootOutcome(None, None, None, str(exc))
    if root is None:
        return BootOutcome(None, None, None, "key bundle: no bundle configured and none in the store (set bundle: "
                           "to a bundle directory, or push one)", unservable=True)
    if store is None and (why := bundle_path_problem(root)) is not None:
        return BootOutcome(None, None, None, f"key bundle: {why}", unservable=True)
    # a serving process that died under its candidate's marker: recorded before the child reads the ledger
    recover_serving_crashes(cfg.state_dir / "selftest", CrashLedger(cfg.state_dir / "selftest"))
    disk_full = None
    try:
        try:
            proof = prove(root, cfg)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            cfg, disk_full = in_memory_state(cfg, exc)
            recover_serving_crashes(cfg.state_dir / "selftest", CrashLedger(cfg.state_dir / "selftest"))
            proof = prove(root, cfg)
    except AgentError as exc:  # a reason, never a traceback in job.failed
        return _no_report(root, str(exc))
    proof = last_resort(root, cfg, proof)
    if disk_full is not None and proof.report is not None:
        proof.report["warnings"] = [disk_full, *proof.report.get("warnings", [])]
        proof.report["state_disk_full"] = disk_full
    for crash in proof.crashes:
        log.error("boot.step_crashed", step=crash.step, signal=crash.signal)
    if proof.report is None:
        return _no_report(root, proof.error, crashed=bool(proof.crashes), refused=proof.refused)
    # what was seen and not charged (a kill from outside): health and the report say it
    proven_sha = str((proof.report.get("bundle") or {}).get("manifest_sha256") or "")
    noted = proof.report.get("unexplained_deaths", []) + noted_deaths(cfg.state_dir / "selftest", proven_sha)
    if noted:
        proof.report["unexplained_deaths"] = noted
        log.warning("boot.unexplained_deaths", deaths=noted,
                    reason="deaths seen with no evidence against a step: not charged "
                           "(health selftest.unexplained_deaths)")
    try:
        # The child checked every variant's contract and the golden arrays; here only the files are read and
        # their hashes checked (the manifest's sha is compared with the proven one below), and only after the
        # verdict: loading is a step the child is isolated for ("load": a native fault, the OOM killer, a
        # hang), never done in this process before the child survived it.
        bundle = load_bundle(root, check_contracts=False, check_golden=False)
    except AgentError as exc:
        return BootOutcome(None, None, proof.report, str(exc))
    proven = (proof.report.get("bundle") or {}).get("manifest_sha256")
    if proven is not None and proven != bundle.manifest_sha256:
        return BootOutcome(None, None, proof.report,
                           f"{root}: the bundle changed while it was proven (manifest {bundle.manifest_sha256[:12]}, "
                           f"proven {str(proven)[:12]}); nothing unproven serves: reload or restart to prove it again")
    if not proof.passed:
        return BootOutcome(bundle, None, proof.report, proof.reason or "no candidate passed")
    try:
        engine = open_engine(bundle, candidate_from_report(proof.report), cfg)
    except AgentError as exc:
        return BootOutcome(bundle, None, proof.report, str(exc))
    note_served(cfg.state_dir / "selftest", bundle, engine.candidate.key, proof.report)
    return BootOutcome(bundle, engine, proof.report, None)


def note_served(directory: Path, bundle: Bundle, candidate: str, report: dict[str, Any]) -> None:
    """On a loaded device the winner can differ from boot to boot (INT8, then FP32): the same bundle now
    gives other answers. Said in the report (`served_changed`, so health and the report page show it)
    and the journal; `served.json` keeps what served last."""
    path = directory / SERVED_FILE
    last = read_json(path, expect=dict) or {}
    if last.get("bundle") == bundle.manifest_sha256 and last.get("candidate") not in (None, candidate):
        report["served_changed"] = {"previous": last["candidate"], "now": candidate, "since": last.get("at")}
        log.warning("boot.answers_changed", previous=last["candidate"], now=candidate, bundle=bundle.identity,
                    reason="the same bundle serves another candidate than at the last boot: its answers differ")
    write_json_atomic(path, {"bundle": bundle.manifest_sha256, "candidate": candidate,
                             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def last_resort(root: Path, cfg: Config, proof: ChildProof) -> ChildProof:
    """Nothing passed, and only because candidates disproven while serving were skipped (agent.proof.evidence):
    those are proven again and the one that passes serves, flagged (report `serving_disproven`, a warning, STATUS),
    rather than nothing, as a drift in a process with no other candidate keeps serving flagged. A device that can
    serve always serves; the evidence stays and the audit keeps watching it."""
    report = proof.report
    if report is None or proof.passed:
        return proof
    skipped = [f"{c['provider']}:{c['variant']}" for c in report.get("candidates", [])
               if any("disproven while serving" in r for r in c.get("reasons", []))]
    if not skipped or any(c.get("passed") for c in report.get("candidates", [])):
        return proof
    log.error("boot.only_disproven", candidates=skipped,
              reason="no other candidate passed: the disproven ones are proven again, and one that passes serves "
                     "flagged rather than nothing")
    again = prove(root, cfg, extra_args=("--serve-disproven",))
    if not again.passed or again.report is None:
        return proof
    sel = again.report["selected"]
    why = (f"serving {sel['provider']}:{sel['variant']}, disproven while serving (see audit.disproven): no other "
           "candidate passed; `edge-agent selftest --forget-evidence` clears the evidence")
    again.report["serving_disproven"] = why
    again.report["warnings"] = [why, *again.report.get("warnings", [])]
    return again
