"""The serving process's share of the crash ledger: a marker naming the candidate while a serving
session is opened (at boot and at every engine swap) and through its first inferences.

A variant can pass the self-test child and still kill the serving process (only under concurrent
callers, only after a few runs). Without a marker every restart served it again: ready, SIGSEGV,
restart, forever. With one, the next boot finds the marker the dead process left, records
`candidate:<provider>:<variant>` in the same ledger as a crash in the self-test child
(`agent.proof.isolation.CrashLedger`), and the child skips exactly that candidate.

Which thread died: the serving process keeps Python's faulthandler writing to a file of its own
(`serving-<pid>-<token>.fault`), and each marker's in-flight record names the threads running its
session. A native crash dumps "Current thread 0x..." there; the next boot charges the marker whose
session ran on that thread and no other that merely ran beside it (pre, model and post run on their own
threads, so under load a stage is often in flight when the model dies, and the other way round). When
the dump names no thread at all (a crash in one of ORT's own native pool threads), the rules below decide
as before; when it names a Python thread that ran none of the markers' sessions (the main thread under a
SIGABRT from outside, a decoder's or the link's thread), nothing is charged. When the fault file holds no dump at all (SIGKILL, the OOM killer, a stop time-out:
nothing the process raised itself), the death is no evidence against the candidate: it is noted and retried,
and recorded only when it recurs at the same inference in `UNEXPLAINED_DEATHS` processes in a row.

A marker is removed after the first `WATCH_RUNS` inferences completed, when its engine is dropped,
and at a clean exit (a `weakref.finalize`, which also runs at interpreter exit): only a process that
died without unwinding (a signal, the OOM killer) leaves one behind.

Fault injection for tests: `EDGE_AGENT_FAULT="serve:<provider>:<variant>#N=SIGSEGV"` dies before the
N-th inference of that candidate in the serving process (`#0`: while opening its session), signalling
the thread that runs it, as a driver's fault would;
`drift:<provider>:<variant>#N=<factor>` multiplies its float outputs by factor from the N-th
inference on (a weight change after boot, for the audit to find); `audit:<provider>:<variant>#N`
dies in the audit's reference session (`#0`: while opening it). The hook is read only when the
variable is set.
"""

from __future__ import annotations

import faulthandler
import fcntl
import itertools
import os
import re
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from agent.fsio import read_json, write_json_atomic
from agent.logsetup import get_logger
from agent.proof.isolation import CrashLedger, inject_fault, parse_faults
from agent.proof.crash_files import SUSPECTS_FILE  # "<bundle>|<step>" -> {"deaths": n, "at": unix}

from agent.service.flight_record import flight_point, flight_threads

log = get_logger("serving_ledger")

FAULT_ENV = "EDGE_AGENT_FAULT"
PREFIX = "serving-"
WATCH_RUNS = 64  # inferences a new serving session runs under its marker
# After them the marker stays (phase "late") for the engine's life: a death then costs the candidate
# only when it repeats in consecutive serving processes on the same machine boot (a one-off OOM kill
# or an operator's kill -9 does not; a crash loop at inference 100 did, forever).
LATE_DEATHS = 2
SUSPECT_TTL_S = 24 * 3600.0
_ids = itertools.count(1)
# Which process wrote a marker: a PID repeats across restarts (PID 1 in a container, every boot), a
# token drawn at import does not.
PROCESS_TOKEN = uuid.uuid4().hex
FAULT_SUFFIX = ".fault"
# the in-flight record: "1 <thread>,<thread>..." or "0", padded, rewritten in place; room for every thread
# of the largest pools (pipeline workers le=64, 13 to 17 characters a thread)
FLIGHT_BYTES = 2048
_CURRENT_THREAD = re.compile(r"^Current thread (0x[0-9a-f]+)", re.MULTILINE)
_FATAL = "Fatal Python error"  # faulthandler's first line for SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT
# A death with no such dump is no evidence against the candidate (SIGKILL from an operator, the OOM killer,
# a stop time-out): it is noted and retried, and charged only when it recurs at the same inference of the
# same candidate in this many serving processes in a row on one machine boot (a deterministic kill); a kill
# from outside lands at another point each time.
UNEXPLAINED_DEATHS = 3
_fault_file: Any = None  # this process's faulthandler file (kept open: faulthandler writes to its fd)


def boot_id() -> str:
    """This machine boot's id: a marker from another boot was left by a power cut or a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def watch_faults(directory: Path) -> None:
    """Have Python's faulthandler write a native crash's thread and stack to this process's fault file in
    `directory` (held under an flock while the process lives, removed at a clean exit)."""
    global _fault_file
    path = directory / f"{PREFIX}{os.getpid()}-{PROCESS_TOKEN[:12]}{FAULT_SUFFIX}"
    if _fault_file is not None and Path(_fault_file.name) == path:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        f = _locked_fault_file(path)
    except OSError as exc:
        log.warning("serving.fault_file_unwritable", file=str(path), error=str(exc)[:200],
                    reason="a native crash is then blamed on every session in flight, not on its thread")
        return
    if _fault_file is not None:
        _end_fault_file(_fault_file)
    faulthandler.enable(file=f, all_threads=True)
    _fault_file = f
    weakref.finalize(f, _end_fault_file, f)


def _locked_fault_file(path: Path) -> Any:
    """The fault file, created and locked. Between the two another process's `recover` may lock it (not yet
    locked: a dead process's), read it and remove it; faulthandler would then write into a removed file. So
    the lock must be held on the file still at `path`, or it is created again."""
    for _ in range(5):
        f = open(path, "w", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except (BlockingIOError, FileNotFoundError):
            pass  # another process's recover holds it, or removed it: again
        except OSError:
            f.close()
            path.unlink(missing_ok=True)  # never held, so never removed by a recover (it cannot lock it either)
            raise
        f.close()
    raise OSError(f"{path}: removed by another process's recovery each time it was created")


def _end_fault_file(f: Any) -> None:
    if f is _fault_file:
        faulthandler.disable()  # never a dump into a closed (or reused) descriptor
    try:
        Path(f.name).unlink(missing_ok=True)
        f.close()
    except (OSError, ValueError):
        pass


def _crashed_threads(directory: Path) -> dict[str, tuple[bool, int | None]]:
    """The dead processes' fault files: process token prefix -> (whether faulthandler dumped a fatal signal
    there, the crashing thread's id or None). No dump: the process died of something it could not catch
    (SIGKILL, the OOM killer, power loss), no evidence against what it ran. Each file read is removed."""
    out: dict[str, tuple[bool, int | None]] = {}
    for path in sorted(directory.glob(f"{PREFIX}*{FAULT_SUFFIX}")):
        if _fault_file is not None and Path(_fault_file.name) == path:
            continue  # ours
        try:
            with open(path, "r+", encoding="utf-8", errors="replace") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live process's
                try:
                    if os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
                        continue  # removed by another recover, and the name since created again by its owner
                except FileNotFoundError:
                    continue
                text = f.read(1 << 16)
                path.unlink(missing_ok=True)  # under the lock: an owner locking it after this creates it again
        except OSError:
            continue
        m = _CURRENT_THREAD.search(text)
        token = path.name.removesuffix(FAULT_SUFFIX).split("-")[-1]
        out[token] = (bool(m) or _FATAL in text, int(m.group(1), 16) if m else None)
        if m:
            log.error("serving.native_crash", thread=m.group(1), dump=text[:4000],
                      reason="the last serving process died in native code; its threads' stacks follow")
    return out


def _suspects(directory: Path) -> dict[str, Any]:
    doc = read_json(directory / SUSPECTS_FILE, {}, expect=dict)
    return doc if isinstance(doc, dict) else {}


def _write_suspects(directory: Path, doc: dict[str, Any]) -> None:
    try:
        write_json_atomic(directory / SUSPECTS_FILE, doc)
    except OSError as exc:
        log.error("serving.suspects_unwritable", file=str(directory / SUSPECTS_FILE), error=str(exc)[:200])


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink(path: Path, lock_fd: int | None = None, late: dict[str, Any] | None = None) -> None:
    try:
        path.unlink(missing_ok=True)
        path.with_suffix(".lock").unlink(missing_ok=True)
        path.with_suffix(".inflight").unlink(missing_ok=True)
        if late and late.get("key"):  # it served past its first inferences and ended cleanly: no suspect
            doc = _suspects(path.parent)
            popped = [doc.pop(k, None) for k in (late["key"], f"{late['key']}|unexplained")]
            if any(p is not None for p in popped):
                _write_suspects(path.parent, doc)
    except OSError:
        pass  # at interpreter exit the directory may be gone (a test's temporary state)
    _close_fd(lock_fd)


def _hold_lock(path: Path) -> int | None:
    """An exclusive flock on the marker's `.lock` file, held as long as this process lives: the kernel
    drops it when the process dies, however it dies, so `recover` tells a live marker (another agent
    on this state dir, `edge-agent run` beside the service) from a dead one without trusting PIDs."""
    try:
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _held_by_a_live_process(path: Path) -> bool:
    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False  # no lock file: a marker of an older agent, or its lock is gone with it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def serving_faults(version: int | str) -> dict[str, str]:
    """The `serve:` faults of `EDGE_AGENT_FAULT` for this bundle version ("step@<version>" hits one)."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return {}
    return {k.removesuffix(f"@{version}"): v for k, v in parse_faults(raw).items()
            if k.startswith(("serve:", "drift:", "slow:", "audit:", "stage:")) and ("@" not in k or k.endswith(f"@{version}"))}


_serving: "weakref.WeakSet[ServingWatch]" = weakref.WeakSet()  # this process's serving sessions' watches


class ServingWatch:
    """One serving session's marker: written before the session is opened, removed after its first
    `runs` inferences. `before`/`after` wrap each inference; after the watch ends they cost one
    attribute read."""

    def __init__(self, directory: Path, bundle_sha: str, candidate: str, runs: int = WATCH_RUNS,
                 faults: Mapping[str, str] | None = None, step: str | None = None, fault: str = "serve"):
        directory.mkdir(parents=True, exist_ok=True)
        # the token in the name too: two containers on one state dir are both PID 1
        self.path = directory / f"{PREFIX}{os.getpid()}-{PROCESS_TOKEN[:12]}-{next(_ids)}.json"
        lock_fd = _hold_lock(self.path)
        self.bundle_sha, self.candidate, self.runs = bundle_sha, candidate, runs
        # the ledger step a death here costs: the serving candidate, or (the audit's reference session)
        # `audit:<key>`, which turns the live audit off and costs no serving candidate
        self.step = step or f"candidate:{candidate}"
        self.fault = fault  # the fault hook's name: "serve:<key>#N", "audit:<key>#N", a stage's "stage:post#N"
        self._fault_key = step if fault == "stage" and step else f"{fault}:{candidate}"
        self.stages: list[ServingWatch] = []  # the bundle's stage graphs' watches: they end with this one
        self.faults = dict(faults or {})
        prefix = f"drift:{candidate}#"
        self._drift = next(((int(k.removeprefix(prefix)), float(v)) for k, v in self.faults.items()
                            if k.startswith(prefix)), None) if fault == "serve" else None
        # a test fault: from the N-th inference on, each run takes `factor` times as long ("slow:<key>#N=5")
        slow = f"slow:{candidate}#"
        self._slow = next(((int(k.removeprefix(slow)), float(v)) for k, v in self.faults.items()
                           if k.startswith(slow)), None) if fault == "serve" else None
        self._began = threading.local()
        self.active = True
        self._started = self._done = 0
        self._lock = threading.Lock()
        self._late: dict[str, Any] = {}  # set once past the first inferences (read by the finalizer)
        if fault == "serve":
            # A new serving session replaces the one serving now (a swap, a reload): the old marker must
            # not stay up beside the new one, or a death opening the new session is charged to both (the
            # old engine is kept for probation's restore, so it is not dropped).
            for old in list(_serving):
                old.end()
            _serving.add(self)
        # One byte beside the marker, rewritten in place (no fsync: it must survive a process's death, not a
        # power cut): 1 while the session opens or an inference runs, 0 between them. A process killed
        # while nothing of the candidate ran (a hung camera's watchdog abort, an operator's SIGKILL between
        # frames) did not die of the candidate and is not charged to it.
        self._threads: dict[int, int] = {}  # thread id -> its runs in flight (the session may be shared)
        self._flight_fd: int | None = None
        self._flight_len = 0  # the longest record written: a shorter one is padded over it
        try:
            self._flight_fd = os.open(self.path.with_suffix(".inflight"), os.O_RDWR | os.O_CREAT, 0o600)
            self._threads[threading.get_ident()] = 1  # the opening thread, until opened()
            self._flight()
        except OSError:
            self._flight_fd = None  # no byte: a death under the marker is charged as before
        # a watch collected without end() (an engine dropped on an error path) closes its descriptor too;
        # not at interpreter exit, where a daemon thread may still write the record (the exit closes it)
        self._close_flight = weakref.finalize(self, _close_fd, self._flight_fd)
        self._close_flight.atexit = False
        # before the marker's write: a write that fails (a full disk) still closes the lock's descriptor
        self._finalizer = weakref.finalize(self, _unlink, self.path, lock_fd, self._late)
        self._write("opening the serving session")
        inject_fault(f"{self._fault_key}#0", self.faults)

    def _write(self, phase: str, late: bool = False) -> None:
        try:
            write_json_atomic(self.path, {"bundle": self.bundle_sha, "candidate": self.candidate, "step": self.step,
                                          "pid": os.getpid(), "process": PROCESS_TOKEN, "phase": phase,
                                          "at": time.time(), "late": late, "boot_id": boot_id()})
        except OSError as exc:
            # a full or read-only state disk: the session opens and serves all the same (a swap away from a
            # disproven candidate must not fail for it); a death under this session then has no marker and is
            # charged to nobody (charged only with evidence)
            log.warning("serving.marker_unwritten", candidate=self.candidate, phase=phase, error=str(exc),
                        detail="no crash marker for this session: a death now is charged to no candidate")

    def end(self) -> None:
        """This session no longer serves first: its marker goes (a death now is not its)."""
        self.active = False
        _serving.discard(self)
        for stage in self.stages:
            stage.end()
        self._finalizer()
        with self._lock:  # never closed under a record being written: its number is soon another file's
            self._flight_fd = None
        self._close_flight()  # closes it once, here or when the watch is collected

    def _flight(self) -> None:
        """Rewrite the in-flight record: running while any thread has a run in flight (or the session opens).
        Padded only over the longest record before it, so a run costs a write of a few bytes."""
        if self._flight_fd is not None:
            record = "0"
            if self._threads:
                ids = [f"{t:x}" for t in self._threads]
                # the inference it is at: the point an unexplained death is compared by across processes
                while len(record := "1 " + ",".join(ids) + f" #{self._started}") > FLIGHT_BYTES:
                    ids.pop()  # whole ids only: a cut one would name some other thread
            self._flight_len = max(self._flight_len, len(record))
            try:
                os.pwrite(self._flight_fd, record.encode("ascii").ljust(self._flight_len), 0)
            except OSError:
                pass

    def opened(self) -> None:
        """The session is open: the marker now covers its first inferences."""
        self._write(f"first {self.runs} inferences")
        with self._lock:
            self._threads.clear()
            self._flight()

    def before(self) -> None:
        me = threading.get_ident()
        with self._lock:  # the record says which threads run an inference (several workers share the session)
            self._threads[me] = self._threads.get(me, 0) + 1
            self._started += 1
            n = self._started
            self._flight()
        if self.faults:
            inject_fault(f"{self._fault_key}#{n}", self.faults)
            self._began.at = time.perf_counter()

    def abandon(self) -> None:
        """The run that `before` announced is over (`after` calls it; alone when the run raised)."""
        me = threading.get_ident()
        with self._lock:
            left = self._threads.get(me, 0) - 1
            if left > 0:
                self._threads[me] = left
            else:
                self._threads.pop(me, None)
            self._flight()

    def after(self, outputs: dict[str, Any]) -> dict[str, Any]:
        if self._drift is not None and self._started >= self._drift[0]:
            outputs = {k: v * np.float32(self._drift[1]) if v.dtype.kind == "f" else v for k, v in outputs.items()}
        if self._slow is not None and self._started >= self._slow[0]:
            if self._slow[0] > 0:
                log.warning("serving.fault_slow", candidate=self.candidate, inference=self._started, factor=self._slow[1])
                self._slow = (0, self._slow[1])  # said once
            time.sleep((self._slow[1] - 1.0) * (time.perf_counter() - self._began.at))
        self.abandon()
        if not self.active:
            return outputs
        with self._lock:
            self._done += 1
            finished = self.active and self._done >= self.runs
            if finished:
                self.active = False
        if finished:
            self._late["key"] = f"{self.bundle_sha}|{self.step}"
            try:
                self._write(f"serving, past its first {self.runs} inferences", late=True)
            except OSError:
                self._finalizer()  # no late marker then; never a fault in the serving path
            log.info("serving.watch_done", candidate=self.candidate, inferences=self.runs)
        return outputs


def recover(directory: Path, ledger: CrashLedger) -> list[str]:
    """Record the candidate of each marker a dead serving process left; returns the steps recorded."""
    out: list[str] = []
    dead: list[tuple[dict[str, Any], bool]] = []  # each dead process's markers: (marker, in flight)
    threads: list[set[int]] = []  # beside each: the threads its session ran on when the process died
    points: list[int | None] = []  # ... and the inference it was at
    crashed = _crashed_threads(directory)
    for path in sorted(directory.glob(f"{PREFIX}*.json")):
        doc = read_json(path)
        if isinstance(doc, dict) and doc.get("process") == PROCESS_TOKEN:
            continue  # ours, live (a re-proof or reload in this process)
        if _held_by_a_live_process(path):
            log.info("serving.marker_live", marker=path.name, candidate=doc.get("candidate") if isinstance(doc, dict) else None,
                     reason="another live process on this state dir holds it: not a crash")
            continue
        flight = path.with_suffix(".inflight")
        try:
            raw = flight.read_bytes()
            idle = raw[:1] == b"0"
        except OSError:
            raw, idle = b"", False  # no byte (an older marker, or it could not be written): charged as before
        path.unlink(missing_ok=True)
        path.with_suffix(".lock").unlink(missing_ok=True)
        flight.unlink(missing_ok=True)
        if not isinstance(doc, dict) or not doc.get("candidate") or not doc.get("bundle"):
            continue
        dead.append((doc, not idle))
        threads.append(flight_threads(raw))
        points.append(flight_point(raw))
    # The fault file named the thread that died: its marker is the culprit, the others ran beside it.
    culprits = {i for i, (doc, running) in enumerate(dead)
                if running and (ev := crashed.get(_process(doc)[:12])) is not None and ev[1] is not None
                and ev[1] in threads[i]}
    named = {_process(dead[i][0]) for i in culprits}
    elsewhere = _crashed_elsewhere(dead, threads, crashed)
    # Pre, model and post run on their own threads: a stage in flight beside the model's inference when the
    # process died may not be what died. Charging it refused the whole bundle for a model's crash another
    # candidate could avoid; so then the candidate is charged, and the stage only when it was in flight at
    # LATE_DEATHS deaths in a row (a stage's own crash costs one more boot, on the next candidate, at most).
    model_running = {_process(doc) for doc, running in dead
                     if running and not str(doc.get("step") or "").startswith("stage:")}
    for i, (doc, running) in enumerate(dead):
        idle = not running
        if _process(doc) in elsewhere:
            log.warning("serving.crash_in_another_thread", step=doc.get("step"), candidate=doc["candidate"],
                        reason="the dump names a thread that ran none of the candidate's work: not charged")
            continue
        if running and _process(doc) in named and i not in culprits:
            log.warning("serving.beside_the_crash", step=doc.get("step"), candidate=doc["candidate"],
                        reason="it ran beside the thread that died (named by the fault file): not charged")
            continue
        if idle:
            log.warning("serving.death_between_inferences", candidate=doc["candidate"], phase=doc.get("phase"),
                        reason="the serving process died while none of the candidate's work ran (a watchdog "
                               "abort, a kill): not charged to the candidate")
            continue
        step = str(doc.get("step") or f"candidate:{doc['candidate']}")
        ev = crashed.get(_process(doc)[:12])
        if ev is not None and not ev[0]:
            # its fault file holds no dump: the process did not die of a fault of its own (a process that
            # could keep no fault file is judged by its marker alone, below, as before)
            if _unexplained_death(directory, ledger, doc, step, points[i]):
                out.append(step)
            continue
        if step.startswith("stage:") and _process(doc) in model_running and i not in culprits:
            log.warning("serving.stage_beside_a_crash", step=step, candidate=doc["candidate"],
                        reason="the stage ran beside the candidate's inference when the process died: the "
                               "candidate is charged; the stage if it is in flight at the next death too")
            if _late_death(directory, ledger, doc, step, "in flight beside the model's inference"):
                out.append(step)
            continue
        if doc.get("late"):
            if _late_death(directory, ledger, doc, step):
                out.append(step)
            continue
        ledger.record(step, str(doc["bundle"]), "the serving process died", f"serving: {doc.get('phase', '')}")
        log.error("serving.crash_recorded", candidate=doc["candidate"], step=step, phase=doc.get("phase"),
                  reason="the last serving process died under this candidate; the self-test skips it")
        out.append(step)
    return out


def _crashed_elsewhere(dead: list[tuple[dict[str, Any], bool]], threads: list[set[int]],
                       crashed: Mapping[str, tuple[bool, int | None]]) -> set[str]:
    """Processes whose fault file names a Python thread that ran none of their sessions (faulthandler names a
    "Current thread" only for a Python thread; a crash in ORT's native pool threads names none): the main
    thread under a SIGABRT from outside, a decoder's or the link's thread: no evidence against a candidate."""
    ran: dict[str, set[int]] = {}
    for (doc, _), th in zip(dead, threads):
        ran.setdefault(_process(doc), set()).update(th)
    return {proc for proc, th in ran.items()
            if (ev := crashed.get(proc[:12])) is not None and ev[1] is not None and ev[1] not in th}


def _process(doc: Mapping[str, Any]) -> str:
    return str(doc.get("process") or doc.get("pid") or "")


def _deaths_in_a_row(directory: Path, key: str,
                     same: Callable[[Mapping[str, Any]], bool] = lambda prev: True) -> tuple[dict[str, Any], int]:
    """The suspects file and the deaths in a row under `key` counting this one: the count starts again after
    SUSPECT_TTL_S, or when the last death was not `same` as this one."""
    suspects = _suspects(directory)
    prev = suspects.get(key)
    go_on = (isinstance(prev, dict) and time.time() - float(prev.get("at", 0) or 0) < SUSPECT_TTL_S and same(prev))
    return suspects, (int(prev.get("deaths", 0) or 0) if go_on and isinstance(prev, dict) else 0) + 1


def _late_death(directory: Path, ledger: CrashLedger, doc: Mapping[str, Any], step: str,
                why: str = f"past its first {WATCH_RUNS} inferences") -> bool:
    """A serving process died past its candidate's first inferences (or, `why`, beside another's run):
    recorded when it is the `LATE_DEATHS`-th such death in a row on this machine boot; True when recorded."""
    if doc.get("boot_id") != boot_id():
        log.info("serving.marker_other_boot", candidate=doc["candidate"],
                 reason="left before the machine rebooted (a power cut): not a crash of the candidate")
        return False
    key = f"{doc['bundle']}|{step}"
    suspects, deaths = _deaths_in_a_row(directory, key)
    if deaths >= LATE_DEATHS:
        suspects.pop(key, None)
        _write_suspects(directory, suspects)
        ledger.record(step, str(doc["bundle"]), "the serving process died",
                      f"serving: {why}, {deaths} processes in a row")
        log.error("serving.crash_recorded", candidate=doc["candidate"], step=step, phase=doc.get("phase"), deaths=deaths,
                  reason="serving processes died under this candidate again and again; the self-test skips it")
        return True
    suspects[key] = {"deaths": deaths, "at": time.time()}
    _write_suspects(directory, suspects)
    log.warning("serving.late_death_noted", candidate=doc["candidate"], deaths=deaths, of=LATE_DEATHS,
                reason="the last serving process died past its first inferences; recorded if the next one does too")
    return False


def _unexplained_key(bundle: str, step: str) -> str:
    return f"{bundle}|{step}|unexplained"


def _unexplained_death(directory: Path, ledger: CrashLedger, doc: Mapping[str, Any], step: str,
                       point: int | None) -> bool:
    """A serving process died under this step with no fatal signal of its own (SIGKILL, the OOM killer, a stop
    time-out): noted, retried, and recorded only as the `UNEXPLAINED_DEATHS`-th death in a row at the same
    inference on this machine boot; True when recorded."""
    where = "opening its session" if point == 0 else f"inference {point}" if point is not None else "an unknown point"
    if doc.get("boot_id") != boot_id():
        log.info("serving.marker_other_boot", candidate=doc["candidate"], step=step,
                 reason="left before the machine rebooted (a power cut): not a crash of the candidate")
        return False
    key = _unexplained_key(str(doc["bundle"]), step)
    suspects, deaths = _deaths_in_a_row(directory, key, lambda prev: prev.get("point") == point)
    if deaths >= UNEXPLAINED_DEATHS:
        suspects.pop(key, None)
        _write_suspects(directory, suspects)
        ledger.record(step, str(doc["bundle"]), "killed with no fatal signal (out of memory?)",
                      f"serving: {where}, {deaths} processes in a row")
        log.error("serving.crash_recorded", candidate=doc["candidate"], step=step, phase=doc.get("phase"),
                  deaths=deaths, point=point,
                  reason="serving processes were killed at the same point under this candidate again and again")
        return True
    suspects[key] = {"deaths": deaths, "at": time.time(), "point": point, "step": step}
    _write_suspects(directory, suspects)
    log.warning("serving.unexplained_death", candidate=doc["candidate"], step=step, phase=doc.get("phase"),
                at=where, deaths=deaths, of=UNEXPLAINED_DEATHS,
                reason="the last serving process died with no fatal signal of its own (SIGKILL, the OOM killer, "
                       "a stop time-out): not charged; retried")
    return False


def noted_deaths(directory: Path, bundle_sha: str) -> list[str]:
    """The deaths noted and not charged for this bundle's steps, for the report and health."""
    out = []
    for key, v in sorted(_suspects(directory).items()):
        if not isinstance(v, dict) or not key.startswith(f"{bundle_sha}|"):
            continue
        step = key.split("|")[1]
        if key.endswith("|unexplained"):
            point = v.get("point")
            where = "opening its session" if point == 0 else f"inference {point}"
            out.append(f"{step}: killed with no fatal signal at {where}, {v.get('deaths')} of "
                       f"{UNEXPLAINED_DEATHS} in a row (not charged)")
        else:
            out.append(f"{step}: died past its first {WATCH_RUNS} inferences, {v.get('deaths')} of "
                       f"{LATE_DEATHS} in a row (not charged)")
    return out
