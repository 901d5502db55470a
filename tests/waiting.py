"""Bounded waiting for tests: poll a condition until it holds or the time is up (never hang)."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(pred: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
