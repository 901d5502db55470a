"""Which candidates to try, in what order, and which passing one wins.

Pure. Providers go in the configured priority order; within a provider, the bundle's preference
order; the winner is the fastest passing variant on the highest-priority provider that has one.
A variant its build marked below a fidelity floor is never a candidate unless the config pins it.
When every candidate that reproduced and kept fidelity failed only on latency, the shell measures
again on `latency_retry_schedule`; a device that stays too slow serves per `when_too_slow`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

from agent.errors import ProviderError
from agent.proof.terms import CPU, ProviderStatus
from agent.quantiles import percentiles
from agent.vocabulary.manifest import Manifest

if TYPE_CHECKING:  # the verdicts (numpy, through parity) only where a candidate is made: agent.config imports this
    from agent.proof.verdict import Candidate, CandidateResult


@dataclass(frozen=True)
class SelectionPolicy:
    provider: str | None = None
    variant: str | None = None
    allow_cpu_fallback: bool = True
    prefer_margin: float = 0.10
    latency_retries: int = 3
    latency_backoff_s: float = 2.0
    when_too_slow: Literal["degraded", "none"] = "none"


def variants_for(manifest: Manifest, provider: str) -> list[str]:
    """Variants meant for this provider, in the bundle's preference order."""
    meant = [v.name for v in manifest.variants if provider in v.providers]
    preferred = [n for n in manifest.preference.get(provider, ()) if n in meant]
    return preferred + [n for n in meant if n not in preferred]


def build_candidates(
    manifest: Manifest,
    statuses: Sequence[ProviderStatus],
    policy: SelectionPolicy,
    options: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[list[Candidate], list[str]]:
    """Candidates in trial order, and notes on providers left out (so the report says why)."""
    options = options or {}
    notes: list[str] = []
    by_name = {s.name: s for s in statuses}
    if policy.provider is not None:
        status = by_name.get(policy.provider)
        if status is None:
            raise ProviderError(f"pinned provider {policy.provider!r} was not probed (probed: {list(by_name)})")
        if not status.usable:
            raise ProviderError(f"pinned provider {policy.provider} is not usable on this device: {status.reason}")
    if policy.variant is not None:
        manifest.variant(policy.variant)  # raises naming the known variants
    out: list[Candidate] = []
    for s in statuses:
        if policy.provider is not None and s.name != policy.provider:
            continue
        if not s.usable:
            notes.append(f"{s.name}: not usable: {s.reason}")
            continue
        if s.name == CPU and not policy.allow_cpu_fallback and policy.provider != CPU:
            notes.append(f"{CPU}: excluded: CPU fallback is forbidden by config (selection.allow_cpu_fallback)")
            continue
        names = variants_for(manifest, s.name)
        if policy.variant is not None:
            names = [n for n in names if n == policy.variant]
        if not names:
            notes.append(f"{s.name}: usable, but the bundle has no variant meant for it")
            continue
        for n in names:
            v = manifest.variant(n)
            below = getattr(v, "below_floor", None)
            if below and policy.variant != n:
                notes.append(f"{s.name}:{n}: not a candidate: its build marked it below a fidelity floor "
                             f"({below}); pin it with selection.variant to serve it anyway")
                continue
            from agent.proof.verdict import Candidate

            out.append(Candidate(s.name, n, v.precision, dict(options.get(s.name, {})),
                                 pinned_below_floor=below or None))
    return out, notes


def provider_groups(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    groups: list[list[Candidate]] = []
    for c in candidates:
        if groups and groups[-1][0].provider == c.provider:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def choose(results: Sequence[CandidateResult], margin: float) -> CandidateResult | None:
    """Among one provider's results (in preference order): the preferred passing variant, unless a
    later passing one is at least `margin` faster at p50."""
    passing = [r for r in results if r.passed]
    if not passing:
        return None
    return passing[pick_index([r.p50 for r in passing], margin)]


def pick_index(p50s: Sequence[float], margin: float) -> int:
    """The margin rule, on p50s in preference order: the first, unless a later one is at least `margin`
    faster than the pick so far (`choose` on results, `picks` on the latency loop's figures)."""
    best = 0
    for i in range(1, len(p50s)):
        if p50s[i] < p50s[best] * (1.0 - margin):
            best = i
    return best


# The latency loop may stop before the bundle's count once its answer cannot change (`latency_settled`):
# a 450 ms model timed 50 times costs 25 s of every boot proof, for a verdict clear after ten.
SETTLE_MIN_RUNS = 10      # timed runs each before the loop may stop
SETTLE_AFTER_S = 2.0      # ...and only once the timed runs have taken this long,
SETTLE_FAST_RUNS = 20     # or, for a fast model, once each candidate has this many timed runs: the demo's 2 x 50
                          # runs were 214 ms of a 1.4 s cold start, for the same verdict (docs/proof.md)
SETTLE_HEADROOM = 0.5     # every candidate's p95 so far at most this fraction of its budget
SETTLE_BAND = 0.03        # p50 ratios this close to 1 - prefer_margin (at least) keep the loop going


def may_settle(done: int, runs: int, timed_s: float) -> bool:
    """Whether the loop has timed enough to ask `latency_settled`: `done` rounds of the `runs` asked, `timed_s`
    seconds of timed runs so far (all candidates). Never before SETTLE_MIN_RUNS rounds, never at the last."""
    return SETTLE_MIN_RUNS <= done < runs and (timed_s >= SETTLE_AFTER_S or done >= SETTLE_FAST_RUNS)


def picks(p50s: Sequence[float], margin: float, providers: Sequence[str]) -> dict[str, int]:
    """What `choose` would pick within each provider if every candidate passed: the index per provider."""
    groups: dict[str, list[int]] = {}
    for i, group in enumerate(providers):
        groups.setdefault(group, []).append(i)
    return {g: idx[pick_index([p50s[i] for i in idx], margin)] for g, idx in groups.items()}


def samples_settled(samples_ms: Sequence[Sequence[float]], budgets: Sequence[float], margin: float,
                    providers: Sequence[str]) -> str | None:
    """`latency_settled` on every candidate's timed runs so far, and on each half of them alone: both halves
    must be settled too and make the same pick as the whole. On a loaded machine a few stolen time slices can
    put one short sample clear of the margin on the wrong side; two independent halves that agree are what
    the full count would have said (the demo under three busy loops flipped its pick in 3 of 10 settled
    proofs on the whole alone)."""
    def stats(part: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
        both = [percentiles(s, (50, 95)) for s in part]
        return [p50 for p50, _ in both], [p95 for _, p95 in both]

    half = min(len(s) for s in samples_ms) // 2
    if half < 1:
        return None
    parts = [samples_ms, [s[:half] for s in samples_ms], [s[half:] for s in samples_ms]]
    whys, chosen = [], []
    for part in parts:
        p50s, p95s = stats(part)
        whys.append(latency_settled(p50s, p95s, budgets, margin, providers))
        chosen.append(picks(p50s, margin, providers))
    if any(w is None for w in whys) or any(c != chosen[0] for c in chosen[1:]):
        return None
    return whys[0]


def latency_settled(p50s: Sequence[float], p95s: Sequence[float], budgets: Sequence[float], margin: float,
                    providers: Sequence[str] | None = None) -> str | None:
    """Why the latency verdict can no longer change, or None. Per candidate in preference order: its p50 and
    p95 so far, its p95 budget and its provider. Settled when every p95 is within SETTLE_HEADROOM of its
    budget (a candidate near or over it is timed in full, so a latency failure is never judged on fewer
    runs) and no comparison `choose` makes sits near the margin: within each provider, every later
    candidate's p50 over every earlier one's is outside 1 - margin +- max(margin / 2, SETTLE_BAND), so no
    small drift of the full count could change the pick. The budget is never moved: only how many runs it
    takes to know."""
    for p95, b in zip(p95s, budgets):
        if not (b > 0 and p95 <= SETTLE_HEADROOM * b):  # NaN never settles
            return None
    half = max(margin / 2, SETTLE_BAND)
    groups = providers if providers is not None else [""] * len(p50s)
    for i in range(len(p50s)):
        for j in range(i + 1, len(p50s)):
            if groups[i] != groups[j]:
                continue  # each provider chooses among its own
            if not p50s[i] > 0:
                return None
            if abs(p50s[j] / p50s[i] - (1.0 - margin)) <= half:
                return None
    worst = max(range(len(p95s)), key=lambda i: p95s[i] / budgets[i])
    return (f"p95 {p95s[worst]:.1f} ms at most {SETTLE_HEADROOM:g} of its budget {budgets[worst]:g} ms"
            + (" and the fastest clear of the margin" if len(p50s) > 1 else ""))


def latency_retry_schedule(retries: int, backoff_s: float, factor: float = 2.0, cap_s: float = 60.0) -> tuple[float, ...]:
    """Seconds to wait before each renewed latency measurement: backoff_s, doubling, each capped."""
    return tuple(min(backoff_s * factor ** i, cap_s) for i in range(max(retries, 0)))


def should_remeasure_latency(results: Sequence[CandidateResult]) -> bool:
    """True when nothing passed and every tested candidate that reproduced and kept fidelity failed
    only on latency (at least one did): a busy machine may be the cause, so measure again."""
    tested = [r for r in results if r.status == "tested"]
    if any(r.passed for r in tested):
        return False
    return any(r.failed_only_on_latency for r in tested)


def fastest_proven(results: Sequence[CandidateResult]) -> CandidateResult | None:
    """Among candidates that failed only on latency, the fastest at p50: what a device that stays too
    slow serves when the config says `when_too_slow: degraded`."""
    proven = [r for r in results if r.failed_only_on_latency]
    return min(proven, key=lambda r: r.p50) if proven else None
