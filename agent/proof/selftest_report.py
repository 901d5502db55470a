"""The self-test's report: what was probed, tried, judged and chosen, why nothing was, what an operator must
see although something serves, and its JSON form (report.json, the cache, `health`).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import onnxruntime as ort

from agent import __version__
from agent.bundle.load import Bundle
from agent.proof.selection import should_remeasure_latency
from agent.proof.terms import ProviderStatus
from agent.proof.verdict import CandidateResult, json_safe

if TYPE_CHECKING:
    pass



REPORT_SCHEMA = 1


@dataclass(frozen=True)
class SelftestReport:
    bundle: Bundle
    providers: tuple[ProviderStatus, ...]
    results: tuple[CandidateResult, ...]
    selected: CandidateResult | None
    notes: tuple[str, ...]
    cache_key: str
    cached: bool
    duration_ms: float
    created: str
    fingerprint: Mapping[str, str]
    latency_attempts: tuple[Mapping[str, Any], ...] = ()
    degraded: str | None = None
    decode: Mapping[str, Any] | None = None  # the reduced-scale decode check of the selected candidate
    costs: tuple[Mapping[str, Any], ...] = ()  # wall and CPU ms of each part of the proof (agent.proof.costs)

    @property
    def decode_max_scale(self) -> int:
        """The largest JPEG decode scale the winning candidate was proven at (1: full-size decode only)."""
        return int((self.decode or {}).get("max_scale", 1))

    @property
    def warnings(self) -> list[str]:
        """What an operator must see although something serves: a pinned below-floor variant, a
        device too slow for the budget."""
        out = [w.text() for w in self.selected.warnings] if self.selected is not None else []
        return out + ([self.degraded] if self.degraded else [])

    @property
    def too_slow(self) -> bool:
        """Nothing proven serves at full speed only because of latency: the one failure a later run on
        a quieter machine can clear (a controller re-runs the self-test on this)."""
        return self.degraded is not None or (self.selected is None and should_remeasure_latency(self.results))

    @property
    def reason(self) -> str | None:
        if self.selected is not None:
            return None
        tested = [r for r in self.results if r.status != "not_tried"]
        if not tested:
            return "no candidate to try: " + ("; ".join(self.notes) or "no usable provider has a variant")
        return "no candidate passed: " + "; ".join(f"{r.candidate.key}: {r.reasons[0]}" for r in tested if r.reasons)

    def to_dict(self) -> dict[str, Any]:
        m = self.bundle.manifest
        sel = self.selected
        return json_safe({
            "schema": REPORT_SCHEMA,
            "created": self.created,
            "agent_version": __version__,
            "bundle": {"name": m.name, "version": m.version, "label": m.label,
                       "manifest_sha256": self.bundle.manifest_sha256, "path": str(self.bundle.root)},
            "versions": {"onnxruntime": ort.__version__, "numpy": np.__version__, "python": platform.python_version()},
            "device": dict(self.fingerprint),
            "providers": [p.to_dict() for p in self.providers],
            "candidates": [r.to_dict() for r in self.results],
            "notes": list(self.notes),
            "selected": None if sel is None else {
                "provider": sel.candidate.provider, "variant": sel.candidate.variant,
                "precision": sel.candidate.precision,
                "effective_providers": list(sel.evidence.effective) if sel.evidence else [],
            },
            "passed": sel is not None,
            "reason": self.reason,
            "warnings": self.warnings,
            "degraded": self.degraded,
            "too_slow": self.too_slow,
            "pinned_below_floor": sel.candidate.pinned_below_floor if sel else None,
            "latency_attempts": [dict(a) for a in self.latency_attempts],
            "decode": dict(self.decode) if self.decode is not None else None,
            "costs": [dict(c) for c in self.costs],
            "cpu_ms": round(sum(float(c.get("cpu_ms", 0)) for c in self.costs), 1),
            "cached": self.cached,
            "cache_key": self.cache_key,
            "duration_ms": round(self.duration_ms, 1),
        })
