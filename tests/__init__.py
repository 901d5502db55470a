"""The test suite: tests/<package>/ holds the tests of agent/<package>/ (docs/testing.md, "Where tests live").

A package so that a test module imports another by its full name (`from tests.serving.test_sensor_backlog import
bundle`) whatever folder it sits in; the helper modules beside this file (agentproc, brokers, waiting, ...) are
importable by their own names from every folder (pyproject.toml: `pythonpath = ["tests"]`)."""
