"""Tests of agent/bundle/."""
