"""Tests of agent/report/."""
