"""Proving a candidate on this device: provider probes, sessions, placement, replay, parity, verdicts, selection, the self-test.

`terms`, `parity`, `verdict` and `selection` are pure; `probe`, `session` and `selftest` touch onnxruntime.
"""
