"""Bundles on disk: load and verify, safe archives, signatures, sample sets, inspect, create.

Built on `spec`; `create` measures variants through `proof` (the one upward arrow).
"""
