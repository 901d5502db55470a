"""A stream's unserved samples as a queue of the chunks they arrived in: appending a chunk costs the chunk,
not the whole buffer.

One array grown by concatenation copied every buffered sample at every arrival: with the agent behind and a
sender of small chunks (MQTT payloads of 16 samples, 16,384 of them for 8 s of audio) the receiving thread
spent its time copying megabytes per message, fell behind the broker, and the broker dropped what its
queue for the agent could not hold. Windows are cut from the front, joining only the chunks a window spans.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Samples:
    """Rows of samples (channels wide), oldest first. Not thread-safe: the stream's source locks."""

    def __init__(self, channels: int):
        self.channels = channels
        self._parts: deque[np.ndarray] = deque()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, rows: np.ndarray) -> None:
        if len(rows):
            self._parts.append(rows)
            self._n += len(rows)

    def head(self, n: int) -> np.ndarray:
        """A copy of the first `n` rows (n <= len): the chunks they span are joined into one, kept in front."""
        if len(self._parts[0]) < n:
            got, take = [], 0
            while take < n:
                part = self._parts.popleft()
                got.append(part)
                take += len(part)
            self._parts.appendleft(np.concatenate(got))
        return self._parts[0][:n].copy()

    def drop(self, n: int) -> None:
        """Drop the first `n` rows (all of them if fewer)."""
        n = min(n, self._n)
        self._n -= n
        while n:
            part = self._parts[0]
            if len(part) <= n:
                self._parts.popleft()
                n -= len(part)
            else:
                self._parts[0] = part[n:]
                n = 0
