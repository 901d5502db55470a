"""Keep proving while serving: our answer to MLPerf's audit tests and TFLite's MiniBenchmark.

The boot proof runs once; serving runs for months. Two low-rate checks run on their own thread:

- **canary**: every `audit.canary_period_s`, one golden sample (round-robin) runs through the live
  engine, the serving path itself (`Engine.run`, source `__audit__`), and is judged for reproduction
  against the variant's recorded outputs (or, for a bundle without them, the engine's own outputs
  when it was attached), within the candidate's reproduction bounds;
- **live audit**: every `audit.live_period_s`, the engine's tap copies one live inference (its tensor
  and the outputs served); the reference variant (`audit.reference`, FP32 on the CPU) runs the same
  tensor, and each `audit.live_window` such frames are judged by the task's fidelity floors.

Drift in either marks the audit `degraded` with the evidence (health, /metrics, STATUS, journal) and
asks the controller to re-prove (`take_drift`). The tap costs one clock read per inference; the work is
one golden inference per canary period and two inferences per live period.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from agent.proof.evidence import EvidenceLedger
from agent.proof.terms import CPU
from agent.logsetup import get_logger
from agent.proof.parity import (
    fidelity_floors,
    judge_fidelity,
    judge_reproduction,
    reproduction_bounds,
)
from agent.proof.stage_proof import used_outputs
from agent.proof.verdict import Candidate
from agent.serving.engine import AUDIT_SOURCE, Engine, build_engine
from agent.service.slowness import SlowWatch
from agent.vocabulary.batch_axis import batch_size
from agent.vocabulary.decoders import split_batch

log = get_logger("audit")

FIRST_CHECK_S = 5.0


class AuditTap:
    """Set on an engine at open; `fn` is bound by the auditor that watches it (None: not sampled)."""

    fn: Callable[[Engine, np.ndarray, dict[str, np.ndarray]], None] | None = None


@dataclass(frozen=True)
class AuditSettings:
    enabled: bool = True
    canary_period_s: float = 60.0
    live_period_s: float = 30.0
    live_window: int = 8
    reference: str = "fp32"
    switch_on_drift: bool = True
    evidence_ttl_s: float = 86400.0
    slow_factor: float = 3.0
    slow_period_s: float = 30.0

    @staticmethod
    def from_config(cfg: Any) -> "AuditSettings":
        a = getattr(cfg, "audit", None)
        if a is None:
            return AuditSettings()
        return AuditSettings(a.enabled, a.canary_period_s, a.live_period_s, a.live_window, a.reference,
                             a.switch_on_drift, a.evidence_ttl_s, a.slow_factor, a.slow_period_s)


@dataclass(frozen=True)
class Canary:
    """What a canary run needs of one golden sample: its tensor and the outputs it must reproduce. Not the
    GoldenSample itself, whose raw frame (2.4 MB each on the YOLO-320 bundle, 14 MB for its six) the audit
    never reads and would hold for as long as the engine serves."""

    index: int
    input: np.ndarray
    expected: dict[str, np.ndarray]


class Auditor:
    """Watches whatever engine `current()` returns (re-attaching after a boot, reload or swap)."""

    def __init__(self, settings: AuditSettings, current: Callable[[], Engine | None], session_settings: Any,
                 clock: Callable[[], float] = time.monotonic):
        self.s, self.current, self.session_settings, self.clock = settings, current, session_settings, clock
        self._engine: Engine | None = None
        self._golden: list[Canary] = []
        self._reference: Engine | None = None
        self._reference_error: str | None = None
        self.reference_shared = False  # the served session is the reference (no second session)
        self._recorded = False  # every golden sample has this variant's recorded outputs (the canary's reference)
        self._next_canary = self._next_live = 0.0
        self._canary_i = 0
        self._samples: queue.Queue = queue.Queue(maxsize=4)
        self._window: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._drift: dict[str, Any] | None = None  # taken by the controller once
        self.counters = {"canary_runs": 0, "canary_failures": 0, "live_samples": 0, "live_windows": 0,
                         "live_drift": 0, "errors": 0}
        self.degraded: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}
        self.disproven: list[dict[str, Any]] = []  # serving evidence that applies to this bundle (evidence.py)
        # the serving pipeline's inference histogram (set by the controller): a variant turning slow (slowness.py)
        self.latency_histogram: Callable[[], Any] = lambda: None
        self.slowness = SlowWatch(settings.slow_factor, settings.slow_period_s, clock)

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> "Auditor":
        if self.s.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="audit", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            d = self.to_dict()
            log.info("audit.summary", state=d["state"], degraded=d["degraded"], **self.counters)

    def take_drift(self) -> dict[str, Any] | None:
        """The drift found since the last call (the controller re-proves once per finding)."""
        with self._lock:
            d, self._drift = self._drift, None
        return d

    # -- the engine's tap (inference threads) -------------------------------------------------------------
    def _tap(self, engine: Engine, tensor: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        if self.clock() < self._next_live or engine is not self._engine:
            return
        self._next_live = self.clock() + self.s.live_period_s
        try:
            self._samples.put_nowait((np.array(tensor, copy=True), {k: np.array(v, copy=True) for k, v in outputs.items()}))
        except queue.Full:
            pass  # the auditor is behind: skip this one

    # -- the audit thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._step()
            except Exception as exc:  # an audit fault must never touch serving
                self.counters["errors"] += 1
                log.error("audit.error", error=f"{type(exc).__name__}: {exc}"[:300])

    def _step(self) -> None:
        engine = self.current()
        if engine is not self._engine:
            self._attach(engine)
        if self._engine is None:
            return
        self.slowness.step(self._engine, self.latency_histogram())
        now = self.clock()
        if self._golden and now >= self._next_canary:
            self._next_canary = now + self.s.canary_period_s
            self._canary()
        try:
            tensor, served = self._samples.get_nowait()
        except queue.Empty:
            return
        self._live(tensor, served)

    def _attach(self, engine: Engine | None) -> None:
        old = self._engine
        if old is not None and old.tap is not None:
            old.tap.fn = None
        self._engine, self._golden, self._window = engine, [], []
        self._reference, self._reference_error, self.degraded = None, None, None
        self.reference_shared = False
        while not self._samples.empty():
            self._samples.get_nowait()
        if engine is None:
            return
        m = engine.bundle.manifest
        path = getattr(engine.watch, "path", None)  # the ledger's directory (none: an engine built without one)
        self.disproven = EvidenceLedger(path.parent).view(engine.bundle.manifest_sha256) if path is not None else []
        self._recorded = False
        if not m.stateful:  # a stateful model's canary would disturb no source, but its state is per sequence
            golden, recorded = [], True
            for g in engine.bundle.golden_samples():  # one at a time; kept only whole (a bad file: none)
                rec = g.variant_outputs.get(engine.candidate.variant)
                # recorded outputs are the reference; a bundle without them: the engine as it was attached
                if rec and all(k in rec for k in m.output_names):
                    expected = {k: rec[k] for k in m.output_names}
                else:
                    expected, recorded = engine.run(g.input, AUDIT_SOURCE), False
                golden.append(Canary(g.index, g.input, split_batch(expected, 0, m.batch_axes)))
            self._golden, self._recorded = golden, recorded and bool(golden)
        # the first checks soon after a new engine serves (a swap's fault shows in seconds), then the periods
        self._next_canary = self.clock() + min(self.s.canary_period_s, FIRST_CHECK_S)
        self._next_live = self.clock() + min(self.s.live_period_s, FIRST_CHECK_S)
        # Live frames only where the reference can be fed exactly as serving fed them: no state carried
        # between frames (sampled frames are not consecutive) and no per-frame metadata inputs.
        if engine.tap is not None and not m.stateful and not m.inputs:
            engine.tap.fn = self._tap
        log.info("audit.attached", candidate=engine.candidate.key, golden=len(self._golden),
                 canary_period_s=self.s.canary_period_s, live_period_s=self.s.live_period_s)

    def _canary(self) -> None:
        engine = self._engine
        assert engine is not None
        i = self._canary_i % len(self._golden)
        self._canary_i += 1
        g = self._golden[i]
        m = engine.bundle.manifest
        got = split_batch(engine.run(g.input, AUDIT_SOURCE), 0, m.batch_axes)
        bounds = reproduction_bounds(engine.candidate.precision, engine.candidate.provider, m.selftest.reproduction)
        mine, want = used_outputs(m, [got], [g.expected])  # postprocess.uses: the rest are never judged
        q = judge_reproduction(m.postprocess, mine, want, bounds, "variant", stage="canary")
        self.counters["canary_runs"] += 1
        self.last["canary"] = {"sample": g.index, "passed": q.passed, "at_unix": round(time.time(), 3)}
        if not q.passed:
            self.counters["canary_failures"] += 1
            self._found("canary", engine, {"sample": g.index, "findings": [f.text() for f in q.findings]})

    def _reference_engine(self, engine: Engine) -> Engine | None:
        if self._reference is None and self._reference_error is None:
            if (engine.candidate.provider == CPU and engine.candidate.variant == self.s.reference
                    and not engine.candidate.options and self._recorded):
                # The served session is the reference (same variant, provider and settings): a second
                # session of the same model cost 25 MB on a one-camera YOLO-320 agent. What it would catch, a
                # served session whose answers changed, the canary catches against the bundle's RECORDED
                # outputs of this variant (hence only where every golden sample has them: a canary judged
                # against the engine as attached would share the change). The live check then pins that
                # what was served is what the session gives for that tensor now.
                self._reference, self.reference_shared = engine, True
                return engine
            live = engine.watch
            if live is not None and live.active:
                # While the served candidate's crash marker is up, a death opening the reference would be
                # charged to the served candidate too: open it only once that marker is gone.
                return None
            m = engine.bundle.manifest
            try:
                v = m.variant(self.s.reference)
                c = Candidate(CPU, v.name, v.precision)
                watch = self._reference_watch(engine, c.key)
                if watch is None:
                    return None
                self._reference = build_engine(engine.bundle, c, self.session_settings,
                                               watch=None if watch is False else watch)
            except Exception as exc:
                self._reference_error = f"reference {self.s.reference} on CPU: {type(exc).__name__}: {exc}"[:300]
                log.warning("audit.no_reference", reason=self._reference_error)
        return self._reference

    def _reference_watch(self, engine: Engine, key: str) -> Any:
        """The reference session's own crash marker (step `audit:<key>`), in the served engine's ledger:
        a reference that kills the serving process costs the live audit at the next boot, not a crash
        loop and not the served candidate. None: it crashed before (the live audit is off); False: no
        ledger here (an engine built without a watch)."""
        from agent.proof.isolation import CrashLedger
        from agent.service.serving_ledger import ServingWatch

        path = getattr(engine.watch, "path", None)
        if path is None:
            return False
        step, sha = f"audit:{key}", engine.bundle.manifest_sha256
        rec = CrashLedger(path.parent).active(sha).get(step)
        if rec is not None:
            self._reference_error = f"reference {key}: {rec.describe()}; the live audit is off"[:600]
            log.warning("audit.no_reference", reason=self._reference_error)
            return None
        return ServingWatch(path.parent, sha, key, faults=engine.watch.faults, step=step, fault="audit")

    def _live(self, tensor: np.ndarray, served: dict[str, np.ndarray]) -> None:
        engine = self._engine
        assert engine is not None
        ref_engine = self._reference_engine(engine)
        if ref_engine is None:
            return
        ref = ref_engine.run(tensor, AUDIT_SOURCE)
        axes = engine.bundle.manifest.batch_axes
        for r in range(batch_size(served, axes)):
            self._window.append((split_batch(served, r, axes), split_batch(ref, r, axes)))
        self.counters["live_samples"] += 1
        if len(self._window) < max(self.s.live_window, 1):
            return
        window, self._window = self._window, []
        m = engine.bundle.manifest
        served_used, ref_used = used_outputs(m, [w[0] for w in window], [w[1] for w in window])
        q = judge_fidelity(m.postprocess, served_used, ref_used,
                           fidelity_floors(m.task, m.selftest.fidelity), stage="live audit")
        self.counters["live_windows"] += 1
        self.last["live"] = {"frames": len(window), "passed": q.passed, "at_unix": round(time.time(), 3),
                             "metrics": dict(q.agreement.metrics) if q.agreement else None}
        log.info("audit.live_window", candidate=engine.candidate.key, frames=len(window), passed=q.passed,
                 canary_runs=self.counters["canary_runs"])
        if not q.passed:
            self.counters["live_drift"] += 1
            self._found("live", engine, {"frames": len(window), "findings": [f.text() for f in q.findings]})

    def _found(self, check: str, engine: Engine, evidence: dict[str, Any]) -> None:
        doc = {"check": check, "candidate": engine.candidate.key, "reference": f"CPU:{self.s.reference}",
               "at_unix": round(time.time(), 3), **evidence}
        log.error("audit.drift", **doc)
        with self._lock:
            first = self.degraded is None
            self.degraded = doc
            if first:
                self._drift = doc

    # -- health -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        e = self._engine
        state = "off" if not self.s.enabled else ("degraded" if self.degraded else ("ok" if e else "idle"))
        return {"state": state, "candidate": e.candidate.key if e else None,
                "reference": f"CPUExecutionProvider:{self.s.reference}", "reference_error": self._reference_error,
                "reference_shared": self.reference_shared,
                "canary_period_s": self.s.canary_period_s, "live_period_s": self.s.live_period_s,
                **self.counters, "last": dict(self.last), "degraded": self.degraded, "slow": self.slowness.slow,
                "disproven": list(self.disproven)}


def loud_state(selftest_doc: dict[str, Any] | None, audit: dict[str, Any] | None) -> str | None:
    """What STATUS and the journal must say beside "serving": degraded or pinned below floor."""
    parts = []
    if audit and audit.get("degraded"):
        d = audit["degraded"]
        parts.append(f"DEGRADED: {d['check']} audit of {d['candidate']} drifted")
    served = (audit or {}).get("candidate")
    for e in (audit or {}).get("disproven") or []:  # the next proven one serves in its place (evidence.py)
        if e["candidate"] != served:
            parts.append(f"{e['candidate']} disproven while serving ({e['check']} audit): not selected")
        else:
            parts.append(f"DEGRADED: serving {served}, disproven while serving ({e['check']} audit): no other passed")
    if audit and audit.get("slow"):
        s = audit["slow"]
        parts.append(f"SLOW: {s['candidate']} inference {s['ratio']:g}x its serving baseline for {s['period_s']:g} s")
    doc = selftest_doc or {}
    if doc.get("degraded"):
        parts.append("DEGRADED: too slow for its budget")
    if doc.get("pinned_below_floor"):
        parts.append("PINNED BELOW FLOOR")
    return "; ".join(parts) or None
