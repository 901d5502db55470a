"""What the agent does with evidence from serving: remember it against the candidate, switch away from it.

The audit (audit.py) finds drift: a canary that no longer reproduces, or a live window that disagrees with
the reference. That finding is charged to the served candidate in the serving-evidence ledger
(agent.proof.evidence: persisted, with an expiry, cleared by `edge-agent selftest --forget-evidence`), which
every later self-test reads, so a golden-only re-proof (which a variant right only on the golden inputs passes
again) never selects it while the evidence applies. Then, with `audit.switch_on_drift` (the default):

- the proof that selected it also proved other candidates: the next of them serves at once (its session is
  opened off the controller and swapped in, as an update's is; serving never stops);
- it proved no other (a cached verdict, or a higher-priority provider's group alone): a reload, whose proof
  skips the disproven candidate; when no other candidate passes there, the reload keeps the proven engine it
  had (a reload never drops a working engine for nothing) and says why, and the drift stays flagged;
- the candidate was disproven before and serves again only because nothing else passed: nothing more is run
  (re-proving it would only loop); the evidence is renewed and health stays degraded.

The disproven candidate is proven again under the conditions that caught it: when its evidence expires it is
a candidate again, and if selected it serves under the same canary and live audit, which charge it again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from agent.errors import AgentError
from agent.logsetup import get_logger
from agent.proof.evidence import EvidenceLedger
from agent.proof.verdict import Candidate

if TYPE_CHECKING:
    from agent.service.controller import Controller

log = get_logger("evidence")

Plan = Literal["switch", "reload", "selftest", "none"]


def ledger_of(controller: "Controller") -> EvidenceLedger:
    return EvidenceLedger(controller.cfg.state_dir / "selftest")


def next_proven(report: dict[str, Any] | None, exclude: set[str]) -> tuple[Candidate, dict[str, Any]] | None:
    """The first candidate of the proof's report (trial order: provider priority, then the bundle's preference)
    that passed and is not excluded, with its entry in the report."""
    for c in (report or {}).get("candidates") or []:
        key = f"{c['provider']}:{c['variant']}"
        if c.get("passed") and key not in exclude:
            return Candidate(c["provider"], c["variant"], c["precision"], dict(c.get("options") or {})), c
    return None


def on_drift(controller: "Controller", drift: dict[str, Any]) -> Plan:
    """Controller thread: charge the drift to the served candidate and say what to do next."""
    c, engine, bundle = controller, controller.served.engine, controller.served.bundle
    if engine is None or bundle is None:
        return "none"
    ledger, sha, key = ledger_of(c), bundle.manifest_sha256, engine.candidate.key
    before = ledger.active(sha)
    detail = "; ".join(str(f) for f in drift.get("findings") or [])[:600] or "drift"
    rec = ledger.record(sha, key, str(drift.get("check", "audit")), detail, c.auditor.s.evidence_ttl_s)
    log.error("evidence.charged", candidate=key, check=rec.check, expires_unix=round(rec.expires, 3),
              detail=rec.detail[:300], reason="remembered against this candidate: a golden-only re-proof does not "
              "clear it; `edge-agent selftest --forget-evidence` does")
    c.auditor.disproven = ledger.view(sha)
    if not c.auditor.s.switch_on_drift:
        return "selftest"
    if key in before:
        log.error("evidence.no_alternative", candidate=key,
                  reason="it serves again only because no other candidate passed: it stays, flagged degraded")
        return "none"
    exclude = set(ledger.active(sha)) | {key}
    return "switch" if next_proven(c.served.report, exclude) is not None else "reload"


def switch_job(controller: "Controller", drift: dict[str, Any]) -> None:
    """Job thread (the operation slot held, released by the caller's _spawn): serve the next proven candidate of
    the proof's report; on failure, a reload (whose proof skips the disproven one)."""
    c = controller
    bundle, report, engine = c.served.bundle, c.served.report, c.served.engine
    if bundle is None or report is None or engine is None:
        return
    exclude = set(ledger_of(c).active(bundle.manifest_sha256)) | {engine.candidate.key}
    found = next_proven(report, exclude)
    if found is None:
        c.call(lambda: c.reloads.request(None))
        return
    cand, entry = found
    switched = {"from": engine.candidate.key, "to": cand.key, "check": drift.get("check"),
                "at_unix": round(time.time(), 3)}
    doc = {**report, "selected": {"provider": cand.provider, "variant": cand.variant, "precision": cand.precision,
                                  "effective_providers": list(entry.get("effective_providers") or [])},
           "pinned_below_floor": cand.pinned_below_floor, "switched": switched}
    try:
        c.updates.swap_bundle(bundle, cand, doc)
    except AgentError as exc:
        log.error("audit.switch_failed", **switched, reason=str(exc)[:300],
                  detail="the next proven candidate did not open: a reload proves again without the disproven one")
        c.call(lambda: c.reloads.request(None))
        return
    log.error("audit.switched", **switched, reason=f"{switched['from']} disproven while serving "
              f"({drift.get('check')} audit): the next proven candidate of the same proof serves")
