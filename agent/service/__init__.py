"""The daemon on top: the controller that wires the components owning the agent's state (what serves, status,
commands, reloads, the updates' host, the operation slot) and runs its event loop, the boot work, the self-test
child process, health views, the CLI and sd_notify.
"""
