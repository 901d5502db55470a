"""Tests of agent/link/."""
