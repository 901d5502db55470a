"""Tests of agent/vocabulary/."""
