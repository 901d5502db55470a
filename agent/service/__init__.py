"""The daemon on top: boot and main loop, the CLI, sd_notify.
"""
