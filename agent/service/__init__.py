"""The daemon on top: the controller that owns the agent's state (bundle, engine, pipeline, store,
updater, outbox) and its event loop, the boot work, the self-test child process, health views, the
CLI and sd_notify.
"""
