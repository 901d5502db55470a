"""Where results go: JSON lines on stdout (the demo and pipes); the MQTT outbox lives in `outbox`."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, TextIO


class JsonLinesSink:
    """One JSON object per line, flushed per line so a reader sees results as they happen."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def write(self, result: dict[str, Any]) -> None:
        line = json.dumps(result, separators=(",", ":"))
        with self._lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except BrokenPipeError:
                pass  # the reader went away (e.g. `| head`); keep serving other sinks

    def close(self) -> None:
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass


class FanOutSink:
    def __init__(self, *sinks: Any):
        self.sinks = sinks

    def write(self, result: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(result)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class NullSink:
    def write(self, result: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
