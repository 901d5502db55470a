"""Tests of agent/service/."""
