"""Evidence from serving, remembered against the candidate it caught (`<state_dir>/selftest/disproven.json`).

The boot proof judges golden inputs only. What serving finds later (the canary's drift on a golden sample
run through the live session, the live audit's disagreement with the reference on real frames, latency
over budget for a sustained period) is evidence a golden-only re-proof cannot see and so must not clear: a
"cheating" variant right on the golden inputs alone passes every golden proof again. Each record names the
bundle, the candidate, the check and its findings, and expires (`audit.evidence_ttl_s`); while one applies
the self-test skips that candidate (a reload, a re-proof and the next boot serve the next proven one), and
`edge-agent selftest --forget-evidence` clears them all. The ledger is files only (no session): the proof's
child reads it, the serving process writes it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.fsio import read_json, write_json_atomic
from agent.proof.crash_files import DISPROVEN_FILE
from agent.logsetup import get_logger

log = get_logger("evidence")

EVIDENCE_TTL_S = 24 * 3600.0  # audit.evidence_ttl_s's default
FORGET_HINT = "`edge-agent selftest --forget-evidence` clears it"


@dataclass(frozen=True)
class ServingEvidence:
    bundle: str       # the manifest sha256 it was caught on (another bundle starts clean)
    candidate: str    # provider:variant
    check: str        # canary | live | latency
    detail: str       # the findings, one line
    at: float         # unix time caught
    expires: float    # unix time it stops applying

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ServingEvidence":
        return ServingEvidence(str(d["bundle"]), str(d["candidate"]), str(d["check"]), str(d.get("detail", "")),
                               float(d["at"]), float(d["expires"]))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires))
        return (f"disproven while serving: {self.check} check at {when} ({self.detail[:200]}); "
                f"applies until {until}, or {FORGET_HINT}")


class EvidenceLedger:
    """The serving evidence of one state directory's self-test (`<state_dir>/selftest`)."""

    def __init__(self, directory: Path):
        self.file = directory / DISPROVEN_FILE
        # records this ledger could not write (a full disk): still applied in this process
        self._unsaved: list[ServingEvidence] = []

    def _all(self) -> list[ServingEvidence]:
        raw = read_json(self.file, [], expect=list)
        out = []
        for d in raw if isinstance(raw, list) else []:  # a damaged file reads as no records
            try:
                out.append(ServingEvidence.from_dict(d))
            except (KeyError, TypeError, ValueError):
                continue
        saved = {(r.bundle, r.candidate) for r in out}
        return out + [r for r in self._unsaved if (r.bundle, r.candidate) not in saved]

    def active(self, bundle_sha: str, now: float | None = None) -> dict[str, ServingEvidence]:
        """candidate key -> the evidence that still applies to it in this bundle."""
        now = time.time() if now is None else now
        return {r.candidate: r for r in self._all() if r.bundle == bundle_sha and r.expires > now}

    def record(self, bundle_sha: str, candidate: str, check: str, detail: str, ttl_s: float) -> ServingEvidence:
        now = time.time()
        rec = ServingEvidence(bundle_sha, candidate, check, detail, now, now + ttl_s)
        keep = [r for r in self._all() if r.expires > now and (r.bundle, r.candidate) != (bundle_sha, candidate)]
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.file, [asdict(r) for r in keep + [rec]])
        except OSError as exc:  # a full state disk: remembered in this process, said in the journal
            self._unsaved = [r for r in self._unsaved if (r.bundle, r.candidate) != (bundle_sha, candidate)] + [rec]
            log.error("evidence.unwritable", file=str(self.file), candidate=candidate,
                      error=f"{type(exc).__name__}: {exc}"[:300],
                      reason="remembered until this process ends only: free the disk")
        return rec

    def view(self, bundle_sha: str) -> list[dict[str, Any]]:
        """Health's `audit.disproven`: the evidence that applies to this bundle's candidates."""
        return [{"candidate": r.candidate, "check": r.check, "detail": r.detail[:300], "at_unix": round(r.at, 3),
                 "expires_unix": round(r.expires, 3)} for r in self.active(bundle_sha).values()]

    def forget(self) -> int:
        n = len(self._all())
        self.file.unlink(missing_ok=True)
        self._unsaved = []
        return n


def applying(directory: Path | None, bundle: Any, opts: Any) -> dict[str, ServingEvidence]:
    """What a self-test of `bundle` skips: the evidence that applies in its state dir (none without one, and none
    for the last resort's proof, `opts.serve_disproven`: agent/service/boot.py's `last_resort`)."""
    if directory is None or opts.serve_disproven:
        return {}
    return EvidenceLedger(directory).active(bundle.manifest_sha256)
