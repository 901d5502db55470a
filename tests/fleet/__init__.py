"""Tests of agent/fleet/."""
