"""Bounded waiting for tests: poll a condition until it holds or the time is up (never hang)."""

from __future__ import annotations

import subprocess
import time
from typing import Callable


def wait_until(pred: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def end_process(proc: "subprocess.Popen | None", graceful: bool = True, timeout: float = 30.0) -> None:
    """SIGTERM and wait (then SIGKILL if it hangs), or SIGKILL at once; nothing if it already ended."""
    import signal

    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
