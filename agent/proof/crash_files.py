"""The names of the crash-evidence files in `<state_dir>/selftest`, spelled once.

The self-test in the child (`crash_markers.CrashMarkers`) and the parent that judges its death
(`isolation.CrashLedger`) read and write the same files; a name spelled twice drifted once.
"""

STEP_FILE = "step.json"        # written by the child before loading and before each probe
INFLIGHT_FILE = "inflight.json"  # written by the self-test before each candidate trial (cached or full)
SKIP_FILE = "crashed.json"     # the self-test's skip list: "<bundle sha>|<provider>:<variant>" -> when
RECORDS_FILE = "crashes.json"  # the full crash records, with signal, versions and expiry
CACHE_FILE = "cache.json"       # the proof's cached verdict: its key, the winner and its report
SUSPECTS_FILE = "late-deaths.json"  # deaths with no evidence, per "<bundle>|<step>": charged at the third
SERVED_FILE = "served.json"    # the serving process's marker: which candidate serves, and at which inference
DISPROVEN_FILE = "disproven.json"
PROOF_DEATHS_FILE = "proof-deaths.json"  # proofs in which a step died UNEXPLAINED_DEATHS times with no evidence  # evidence from serving (canary, live audit) per candidate: agent.proof.evidence
# what a boot on a full state disk copies to its memory directory: the evidence and the cache, never a marker
EVIDENCE_FILES = (RECORDS_FILE, CACHE_FILE, SUSPECTS_FILE, SERVED_FILE, DISPROVEN_FILE, PROOF_DEATHS_FILE)
