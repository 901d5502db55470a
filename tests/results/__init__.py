"""Tests of agent/results/."""
