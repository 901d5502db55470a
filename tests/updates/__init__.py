"""Tests of agent/updates/."""
