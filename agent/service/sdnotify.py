"""sd_notify over $NOTIFY_SOCKET (the datagram protocol systemd documents), without libsystemd.

READY=1 once the self-test selected a candidate (or the agent settled in a "not serving" state),
WATCHDOG=1 only while the pipeline makes progress, RELOADING=1 / STOPPING=1 around reloads and stops,
STATUS= always saying what serves and why. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env)
        addr = env.get("NOTIFY_SOCKET")
        if addr and addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self.address = addr
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        mine = pid is None or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec and usec.isdigit() and mine else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *fields: str) -> bool:
        if not self.address:
            return False
        msg = "\n".join(fields).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.connect(self.address)
                s.sendall(msg)
            except OSError:
                return False  # systemd went away or the socket is gone: never fatal
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets systemd >= 253 match the reload; older versions ignore it
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", "STATUS=stopping")
