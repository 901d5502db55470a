"""Tests of agent's top-level modules (agent/config.py, config_schema.py, fsio.py, npio.py, quantiles.py)."""
