"""Tests of agent/source_types/."""
