"""Tests of agent/proof/."""
