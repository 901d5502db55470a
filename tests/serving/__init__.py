"""Tests of agent/serving/."""
