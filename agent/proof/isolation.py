"""The self-test in a child process: a segfault, abort, hang or OOM kill there is a verdict, not a crash loop.

The child (`agent.service.selftest_child`) writes a step marker before each step that can kill it
(loading the bundle; each variant's contract, one variant per step; each provider probe; each
candidate trial, cached winner included; each candidate's share of the interleaved latency loop, the
marker switching before every run). When it dies of a fatal signal of its own (`FATAL_SIGNALS`) or a
step makes no progress (no marker rewritten) for the time-out, the parent reads the marker, records the
step with the signal and the ORT, provider and driver versions, and runs a new child that skips it. A
death with no evidence against the step (SIGKILL: the OOM killer, an operator) is retried, and recorded
only when it recurs at the same point `UNEXPLAINED_DEATHS` times; a slow child that progresses is never
killed. The serving process records into the same ledger (`agent.service.serving_ledger`): a crash there
costs the served candidate at the next boot. A record stops applying when those versions change or when
it expires (`edge-agent selftest --forget-crashes` clears them).

A child ended by SIGTERM, SIGINT or SIGHUP was stopped (systemd stops the whole cgroup), and a marker
left by a child whose agent exited is an interrupted self-test: neither is recorded as a crash. A child
stopped while this process goes on (the child alone signalled: earlyoom, an operator) is proven again, up
to STOP_RETRIES times; when the whole agent stops, the retry dies with it.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from agent.fsio import read_json, write_json_atomic
from agent.logsetup import get_logger
from agent.proof import spare
from agent.proof.probe import provider_versions
from agent.proof.terms import CPU
from agent.proof.crash_files import (  # noqa: F401 (re-exported)
    INFLIGHT_FILE, PROOF_DEATHS_FILE, RECORDS_FILE, SKIP_FILE, STEP_FILE,
)

log = get_logger("isolation")
child_log = get_logger("selftest_child")

PROOF_LOCK = "proof.lock"      # held (flock) by the process running a proof on this state dir
CHILD_MODULE = spare.CHILD_MODULE
CRASH_TTL_S = 7 * 24 * 3600.0
# How a stop ends a child: a shutdown, never a crash of the step it was in
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# a child stopped while its parent goes on (the child alone signalled) is proven again this many times
STOP_RETRIES = 2
MAX_CHILDREN = 8  # each crash removes one step; more than this many crashing steps is a broken install
# The signals a process raises on itself when its own code fails (a driver's fault, an abort): evidence
# against the step it was in. Any other death (SIGKILL: the OOM killer, an operator, a stop time-out) is
# no evidence: retried, and charged only when the same death recurs at the same point this many times in a
# row (a deterministic kill, e.g. a candidate the OOM killer ends at the same run every time).
FATAL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
UNEXPLAINED_DEATHS = 3
# ... and in this many proofs (boots) in a row: deaths with no evidence in one proof alone are an episode (a
# memory-pressure spell that kills whatever runs), skipped for that proof only
UNEXPLAINED_PROOFS = 2
PROOF_DEATHS_TTL_S = 86400.0  # a proof's episode counts toward the next proof's for a day
PROGRESS_POLL_S = 0.5  # how often the parent looks at the child's markers for progress


@dataclass(frozen=True)
class CrashRecord:
    """One step that killed a self-test child."""

    step: str               # "load", "contract:<variant>", "stage:<pre|post>", "probe:<provider>" or "candidate:<provider>:<variant>"
    bundle: str             # manifest sha256; "" for a probe (it does not depend on the bundle)
    signal: str             # "SIGSEGV", "SIGABRT", "SIGKILL (out of memory?)", "timeout after 60 s"
    versions: Mapping[str, str]
    at: float
    expires: float
    detail: str = ""        # where in the step: "latency run 30", "serving inference 3", ...

    @property
    def provider(self) -> str:
        # a contract is read on the CPU provider; probes and candidates name theirs
        return self.step.split(":")[1] if self.step.startswith(("probe:", "candidate:")) else CPU

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "versions": dict(self.versions)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "CrashRecord":
        return CrashRecord(str(d["step"]), str(d.get("bundle", "")), str(d["signal"]), dict(d.get("versions", {})),
                           float(d["at"]), float(d["expires"]), str(d.get("detail", "")))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        where = f" ({self.detail})" if self.detail else ""
        process = "the serving process" if self.detail.startswith("serving") else "the self-test process"
        return (f"{self.step}{where} crashed {process} ({self.signal}) at {when}; retried when onnxruntime, "
                f"provider or driver versions change, after expiry, or with `edge-agent selftest --forget-crashes`")


def signal_name(returncode: int) -> str:
    """How a child ended, named: SIGSEGV, SIGABRT, SIGKILL (what the OOM killer sends)."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"{name} (out of memory?)" if name == "SIGKILL" else name


class CrashLedger:
    """The crash records of one state directory's self-test (`<state_dir>/selftest`).

    `records_dir` (default: `directory`) holds the records: an update's proof, which runs in its own
    state directory, records into the boot's ledger, so a step that crashed there is not retried at
    the next boot. Markers and the skip list stay in `directory`, where the child writes and reads."""

    def __init__(self, directory: Path, ttl_s: float = CRASH_TTL_S, records_dir: Path | None = None):
        self.directory, self.ttl_s = directory, ttl_s
        self.records_file = (records_dir or directory) / RECORDS_FILE
        # records this ledger could not write (a full disk, a read-only or damaged file): still applied by
        # this ledger, so the proof in progress skips the step that crashed instead of re-running it
        self._unsaved: list[CrashRecord] = []
        self._transient: list[CrashRecord] = []  # skipped in this proof only (an episode with no evidence)

    def _all(self) -> list[CrashRecord]:
        out = []
        raw = read_json(self.records_file, [], expect=list)
        for d in raw if isinstance(raw, list) else []:  # a damaged file (`7`, `true`) reads as no records
            try:
                out.append(CrashRecord.from_dict(d))
            except (KeyError, TypeError, ValueError):
                continue  # a record we cannot read cannot protect anything; it is dropped on the next write
        saved = {(r.step, r.bundle) for r in out}
        return out + [r for r in self._unsaved + self._transient if (r.step, r.bundle) not in saved]

    def skip_in_this_proof(self, step: str, bundle_sha: str, how: str, detail: str = "") -> None:
        """Skip `step` for the rest of this proof, recording nothing: what killed it has no evidence against it."""
        now = time.time()
        provider = step.split(":")[1] if step.startswith(("probe:", "candidate:")) else CPU
        self._transient.append(CrashRecord(step, "" if step.startswith("probe:") else bundle_sha, how,
                                           provider_versions(provider), now, now + self.ttl_s, detail))

    def proofs_with_deaths(self, step: str, bundle_sha: str) -> int:
        """Count this proof's episode of unexplained deaths at `step`; returns the proofs in a row (a day apart
        at most) that had one, this one included."""
        path = self.directory / PROOF_DEATHS_FILE
        doc = read_json(path, {}, expect=dict) or {}
        key, now = f"{bundle_sha}|{step}", time.time()
        prev = doc.get(key) if isinstance(doc.get(key), dict) else None
        fresh = prev is not None and now - float(prev.get("at", 0) or 0) < PROOF_DEATHS_TTL_S
        n = (int(prev.get("proofs", 0) or 0) if fresh and prev else 0) + 1
        doc = {k: v for k, v in doc.items() if isinstance(v, dict) and now - float(v.get("at", 0) or 0) < PROOF_DEATHS_TTL_S}
        doc[key] = {"proofs": n, "at": now}
        try:
            write_json_atomic(path, doc)
        except OSError:
            pass  # a full disk: this proof's episode is not remembered (charged later, never sooner)
        return n

    def active(self, bundle_sha: str, now: float | None = None) -> dict[str, CrashRecord]:
        """Records that still apply: this bundle (or any, for probes), not expired, same versions."""
        now = time.time() if now is None else now
        versions: dict[str, dict[str, str]] = {}
        out: dict[str, CrashRecord] = {}
        for r in self._all():
            if r.expires <= now or (r.bundle and r.bundle != bundle_sha):
                continue
            if r.provider not in versions:
                versions[r.provider] = provider_versions(r.provider)
            if dict(r.versions) == versions[r.provider]:
                out[r.step] = r
        return out

    def record(self, step: str, bundle_sha: str, how: str, detail: str = "") -> CrashRecord:
        provider = step.split(":")[1] if step.startswith(("probe:", "candidate:")) else CPU
        now = time.time()
        rec = CrashRecord(step, "" if step.startswith("probe:") else bundle_sha, how, provider_versions(provider),
                          now, now + self.ttl_s, detail)
        keep = [r for r in self._all() if r.expires > now and not (r.step == rec.step and r.bundle == rec.bundle)]
        try:
            write_json_atomic(self.records_file, [r.to_dict() for r in keep + [rec]])
        except OSError as exc:  # never a raise out of the proof: the boot would die before READY
            self._unsaved = [r for r in self._unsaved if (r.step, r.bundle) != (rec.step, rec.bundle)] + [rec]
            log.error("selftest.ledger_unwritable", file=str(self.records_file), step=step,
                      error=f"{type(exc).__name__}: {exc}"[:300],
                      reason="the crash is skipped in this proof only; the next boot retries it: free the "
                             "disk or fix the file's permissions")
        log.error("selftest.step_crashed", step=step, signal=how, detail=detail, bundle=bundle_sha[:12],
                  versions=rec.versions)
        return rec

    def forget(self) -> int:
        n = len(self._all())
        self.records_file.unlink(missing_ok=True)
        for name in (SKIP_FILE, STEP_FILE, INFLIGHT_FILE):
            (self.directory / name).unlink(missing_ok=True)
        return n

    def write_skip_list(self, bundle_sha: str) -> None:
        """What the self-test reads to skip candidates: exactly the records that still apply."""
        skip: dict[str, str] = {}
        for step, r in self.active(bundle_sha).items():
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.at))
            if step.startswith("candidate:"):
                skip[f"{bundle_sha}|{step.removeprefix('candidate:')}"] = when
            elif step.startswith("contract:"):  # that variant on every provider
                skip[f"{bundle_sha}|*:{step.removeprefix('contract:')}"] = when
        write_json_atomic(self.directory / SKIP_FILE, skip)

    def take_step(self) -> str | None:
        """The step a dead child was in (its markers), removing the markers."""
        found = self.take_marker()
        return found[0] if found else None

    def take_marker(self) -> tuple[str, str] | None:
        """(step, detail) of the markers a dead child left, removing them; None when there are none."""
        found = None
        inflight = read_json(self.directory / INFLIGHT_FILE, expect=dict)
        marker = read_json(self.directory / STEP_FILE, expect=dict)
        if inflight and inflight.get("candidate"):
            found = ("candidate:" + str(inflight["candidate"]), str(inflight.get("detail", "")))
        elif marker and marker.get("step"):
            found = (str(marker["step"]), str(marker.get("detail", "")))
        for name in (INFLIGHT_FILE, STEP_FILE):
            (self.directory / name).unlink(missing_ok=True)
        return found


@dataclass(frozen=True)
class ChildProof:
    """What the child self-test concluded: its report, or why there is none; and the crashes on the way."""

    report: dict[str, Any] | None
    error: str | None
    crashes: tuple[CrashRecord, ...] = field(default=())
    # the child ran to its end and refused the bundle with the agent's own error (a variant ONNX Runtime cannot
    # load, a provider the config pins that is not here): the same files and config give the same answer again
    refused: bool = False

    @property
    def passed(self) -> bool:
        return self.report is not None and bool(self.report.get("passed"))

    @property
    def reason(self) -> str | None:
        if self.report is not None:
            return self.report.get("reason")
        return self.error


def bundle_digest(root: Path) -> str:
    from agent.bundle.load import read_manifest

    return read_manifest(root)[1]


def prove_in_child(root: Path, state_dir: Path, config: Path | object | None, timeout_s: float,
                   use_cache: bool = True, extra_args: Sequence[str] = (),
                   env: Mapping[str, str] | None = None, records_dir: Path | None = None) -> ChildProof:
    """Run the self-test of the bundle at `root` in child processes until one finishes.

    A child killed by a signal or the time-out costs the step it was in; the next child skips it.
    `config` is a config file, or the parent's config object itself (handed over pickled: the same
    selection and provider settings, even for a config built in code).

    One proof at a time per state dir (`selftest/proof.lock`, flock): the markers are one file each,
    so a second proof (`edge-agent selftest` beside the service, a second agent) used to clear the
    running child's marker as "interrupted" and overwrite it, and a crash was then charged to the
    wrong candidate or to none. The second waits; the kernel drops the lock however a holder dies."""
    directory = state_dir / "selftest"
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / PROOF_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("selftest.waiting", state_dir=str(state_dir),
                        reason="another process is proving on this state dir; this proof waits for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        return _prove_in_child(root, state_dir, config, timeout_s, use_cache, extra_args, env, records_dir)
    finally:
        os.close(fd)  # releases the lock


def _prove_in_child(root: Path, state_dir: Path, config: Path | object | None, timeout_s: float,
                    use_cache: bool, extra_args: Sequence[str], env: Mapping[str, str] | None,
                    records_dir: Path | None) -> ChildProof:
    directory = state_dir / "selftest"
    ledger = CrashLedger(directory, records_dir=records_dir)
    sha = bundle_digest(root)  # no onnxruntime here: the manifest's bytes
    new: list[CrashRecord] = []
    unexplained: dict[tuple[str, str], int] = {}  # (step, detail) -> deaths there with no evidence
    noted: list[str] = []  # what was seen and not charged, for the report (health shows it)
    stops = 0  # children stopped by a stop signal (SIGTERM, SIGINT, SIGHUP) while this process went on
    # Markers now are a child's whose agent exited mid-proof (stopped, or killed: the child then got
    # SIGKILL from PR_SET_PDEATHSIG): an interrupted self-test, not a crash of that step.
    stale = ledger.take_marker()
    if stale is not None:
        log.warning("selftest.interrupted_marker_cleared", step=stale[0], detail=stale[1],
                    reason="left by a self-test whose agent exited; not a crash")
    while len(new) < MAX_CHILDREN and sum(unexplained.values()) < MAX_CHILDREN * UNEXPLAINED_DEATHS:
        active = ledger.active(sha)
        if "load" in active:
            return ChildProof(None, f"loading the bundle: {active['load'].describe()}", tuple(new))
        stages = [step for step in active if step.startswith("stage:")]
        if stages:  # no candidate serves without its bundle's pre/post graph: the bundle is refused, naming it
            why = "; ".join(f"stage {step.split(':', 1)[1]}: {active[step].describe()}" for step in sorted(stages))
            return ChildProof(None, f"{why}; no candidate can serve this bundle without it", tuple(new))
        ledger.write_skip_list(sha)
        with tempfile.TemporaryDirectory(prefix="selftest-") as tmp:
            out = Path(tmp) / "report.json"
            cmd = [*spare.child_prefix(), "--bundle", str(root), "--state-dir", str(state_dir),
                   "--out", str(out), *extra_args]
            if isinstance(config, Path):
                cmd += ["--config", str(config)]
            elif config is not None:
                (Path(tmp) / "config.pickle").write_bytes(pickle.dumps(config))
                cmd += ["--config-pickle", str(Path(tmp) / "config.pickle")]
            if not use_cache:
                cmd.append("--no-cache")
            if records_dir is not None:
                cmd += ["--crash-records", str(records_dir)]
            child_env = {**os.environ, **(env or {})}
            # the boot's spare (agent.proof.spare) when it is this very process, its imports done already
            proc = spare.adopt(cmd, child_env)
            log.info("selftest.child_started", spare=proc is not None)
            if proc is None:
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=child_env, start_new_session=True, preexec_fn=spare.die_with_parent)
            relay = forward_child_log(proc)
            hung = _wait_while_progressing(proc, directory, timeout_s)
            how = (f"no progress for {timeout_s:g} s (hung)" if hung
                   else signal_name(proc.returncode) if proc.returncode < 0 else None)
            relay.join(timeout=10)
            err = "\n".join(relay.tail)
            if proc.returncode is not None and -proc.returncode in STOP_SIGNALS:
                stops += 1
                if _stopped_retry(ledger, str(how), stops, noted):
                    continue
                return ChildProof(None, f"self-test stopped by {how} (a shutdown, not a crash)", tuple(new))
            if how is not None:
                found = ledger.take_marker()
                if found is None:
                    return ChildProof(None, f"self-test process died ({how}) outside any step", tuple(new))
                if not hung and -proc.returncode not in FATAL_SIGNALS:
                    # no evidence against the step (SIGKILL: the OOM killer, an operator): retried, and
                    # charged only when the same death comes back at the same point UNEXPLAINED_DEATHS times
                    seen = unexplained[found] = unexplained.get(found, 0) + 1
                    if _retry_unexplained(found, how, seen, noted):
                        continue
                    charged = _episode_or_charge(ledger, found, sha, f"{how}, {seen} times in a row at the same point",
                                                 noted)
                    if charged is None:
                        continue
                    how = charged
                new.append(ledger.record(found[0], sha, how, found[1]))
                continue
            doc = read_json(out)
            if not isinstance(doc, dict):
                tail = " ".join((err or "").strip().splitlines()[-2:])[:300]
                return ChildProof(None, f"self-test process failed (exit {proc.returncode}) with no report: {tail}",
                                  tuple(new))
            if doc.get("error"):
                return ChildProof(None, str(doc["error"]), tuple(new), refused=True)
            report = doc["report"]
            report["crashes"] = [r.to_dict() | {"reason": r.describe()} for r in ledger.active(sha).values()]
            if noted:
                report["unexplained_deaths"] = noted
            return ChildProof(report, None, tuple(new))
    return ChildProof(None, f"{len(new)} self-test processes crashed and {sum(unexplained.values())} were killed "
                            "from outside in a row", tuple(new))



def _retry_unexplained(found: tuple[str, str], how: str, seen: int, noted: list[str]) -> bool:
    """The `seen`-th death with no evidence at this point: True to retry (not charged yet)."""
    noted.append(f"{found[0]} ({found[1] or 'no detail'}): {how}, {seen} of {UNEXPLAINED_DEATHS}")
    if seen >= UNEXPLAINED_DEATHS:
        return False
    log.warning("selftest.unexplained_death", step=found[0], detail=found[1], signal=how, deaths=seen,
                of=UNEXPLAINED_DEATHS, reason="no fatal signal of the step's own (a kill from outside, the OOM "
                                              "killer): retried, not charged")
    return True


def _stopped_retry(ledger: CrashLedger, how: str, stops: int, noted: list[str]) -> bool:
    """A child ended by a stop signal: True to prove again (the child alone was stopped: earlyoom and its kind
    send SIGTERM to the largest process, an operator's kill), nothing charged. When the whole agent stops, it
    exits and the retry dies with it (the child's parent-death signal), so a real shutdown is not delayed."""
    found = ledger.take_marker()
    step = found[0] if found else None
    if stops <= STOP_RETRIES:
        log.warning("selftest.child_stopped", signal=how, step=step, retry=stops, of=STOP_RETRIES,
                    reason="a stop of the child alone, not a crash: proven again")
        noted.append(f"{step or 'the self-test'}: {how} from outside, proven again")
        return True
    log.warning("selftest.stopped", signal=how, step=step, reason="a shutdown, not a crash: nothing recorded")
    return False


def _episode_or_charge(ledger: CrashLedger, found: tuple[str, str], sha: str, how: str,
                       noted: list[str]) -> str | None:
    """UNEXPLAINED_DEATHS deaths with no evidence at one point of this proof: None when it is this proof's
    episode alone (a memory-pressure spell kills whatever runs: skipped in this proof only), else how the
    charge reads (the next proof saw it too)."""
    proofs = ledger.proofs_with_deaths(found[0], sha)
    if proofs < UNEXPLAINED_PROOFS:
        ledger.skip_in_this_proof(found[0], sha, how, found[1])
        noted.append(f"{found[0]}: {how}; skipped in this proof, charged if the next proof sees it too")
        log.warning("selftest.unexplained_episode", step=found[0], detail=found[1], signal=how, proofs=proofs,
                    of=UNEXPLAINED_PROOFS, reason="deaths with no evidence in one proof: skipped in this proof only, "
                                                  "not charged")
        return None
    return f"{how}, in {proofs} proofs in a row"

def _progress(directory: Path) -> float:
    """When the child last showed progress: the newest write of its step or in-flight marker (each step,
    each candidate trial and each timed run of the latency loop rewrites one)."""
    newest = 0.0
    for name in (STEP_FILE, INFLIGHT_FILE):
        try:
            newest = max(newest, (directory / name).stat().st_mtime)
        except OSError:
            pass
    return newest


def _wait_while_progressing(proc: subprocess.Popen, directory: Path, bound_s: float) -> bool:
    """Wait for the child while it makes progress; True when it went `bound_s` without any (then killed).

    The bound is per step, not for the whole child: on a loaded machine a healthy candidate still in its
    latency loop took longer than a whole-child cap and was charged as a crash for 7 days; a slow proof is a
    latency verdict (the proof's own business), only a step with no progress at all is a hang."""
    last_seen, last_progress = _progress(directory), time.monotonic()
    while True:
        try:
            proc.wait(timeout=min(PROGRESS_POLL_S, bound_s))
            return False
        except subprocess.TimeoutExpired:
            pass
        seen = _progress(directory)
        now = time.monotonic()
        if seen != last_seen:
            last_seen, last_progress = seen, now
        elif now - last_progress >= bound_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True


class _Relay(threading.Thread):
    """Reads a self-test child's stderr as it comes: each JSON log event is re-emitted by this process
    (so a child's verdicts and latency retries reach the journal, marked `child: true`); the last lines
    are kept for an error message."""

    def __init__(self, stream: Any):
        super().__init__(name="selftest-relay", daemon=True)
        self.stream = stream
        self.tail: collections.deque[str] = collections.deque(maxlen=20)

    def run(self) -> None:
        for line in self.stream:
            line = line.rstrip("\n")
            self.tail.append(line)
            if not line.startswith("{"):
                continue  # native output: captured per candidate as ORT log evidence
            try:
                doc = json.loads(line)
                event = str(doc.pop("event"))
            except (ValueError, KeyError, AttributeError):
                continue
            level = str(doc.pop("level", "info"))
            doc["child_at"] = doc.pop("timestamp", None)
            emit = getattr(child_log, level if level in ("debug", "info", "warning", "error", "critical") else "info")
            emit(event, child=True, **{k: v for k, v in doc.items() if k != "child"})


def forward_child_log(proc: subprocess.Popen) -> _Relay:
    relay = _Relay(proc.stderr)
    relay.start()
    return relay


def parse_faults(spec: str | None) -> dict[str, str]:
    """`EDGE_AGENT_FAULT`: "step=ACTION[;step=ACTION]", ACTION one of SIGSEGV, SIGABRT, SIGKILL, hang."""
    out: dict[str, str] = {}
    for part in (spec or "").split(";"):
        if "=" in part:
            step, action = part.rsplit("=", 1)
            out[step.strip()] = action.strip()
    return out


def inject_fault(step: str, faults: Mapping[str, str]) -> None:
    """Die at `step` as a broken driver would: the signal goes to the calling thread (a fault in native code
    is delivered to the thread that ran it, which the serving process's fault file names). Called only in
    the self-test child and the serving process, only when the fault variable is set."""
    action = faults.get(step)
    if action is None:
        return
    sys.stderr.flush()
    if action == "hang":
        time.sleep(10**6)
    signal.pthread_kill(threading.get_ident(), getattr(signal, action))
    time.sleep(10)  # a signal that is caught or ignored must still not let the step pass


def mark_step(directory: Path, step: str | None, detail: str = "") -> None:
    """The child's marker before a step that may kill it (None: between steps)."""
    if step is None:
        (directory / STEP_FILE).unlink(missing_ok=True)
    else:
        write_json_atomic(directory / STEP_FILE, {"step": step, "detail": detail, "pid": os.getpid(),
                                                  "at": time.time()})


class RunMarker:
    """The in-flight marker rewritten in place before every run of an interleaved latency loop: one
    `pwrite` of a padded record, no fsync (a process crash keeps the page cache; power loss is no
    crash of a candidate), so switching it per run costs microseconds, outside the timed region."""

    WIDTH = 1024

    def __init__(self, path: Path, bundle_sha: str):
        self.path, self.bundle_sha = path, bundle_sha
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)

    def set(self, candidate: str, detail: str) -> None:
        doc = json.dumps({"bundle": self.bundle_sha, "candidate": candidate, "detail": detail})
        os.pwrite(self._fd, doc.encode()[: self.WIDTH].ljust(self.WIDTH), 0)

    def close(self) -> None:
        os.close(self._fd)


def report_json(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2)
