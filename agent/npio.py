"""Reading .npy/.npz files from several threads at once.

NumPy parses every array header with `ast.literal_eval`. In CPython before 3.13 the AST builder keeps its
recursion depth in state shared by all threads, so two threads parsing at once can fail with
`SystemError: AST constructor recursion depth mismatch` (python/cpython#106905). Seen here: a golden
sample rejected as "not a readable .npz" on one of 200 devices updating at once in one process. The
agent parses headers on several threads (an update's loader, proof while serving, an `npy` payload on a
source thread), so every read in the agent goes through this one lock. An NpzFile parses a member's
header when the member is read, so the lock covers the whole `with` block.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_HEADERS = threading.Lock()


@contextmanager
def open_npz(path: Path | str) -> Iterator[np.lib.npyio.NpzFile]:
    """`np.load(path, allow_pickle=False)` of an .npz, its members read inside the block."""
    with _HEADERS, np.load(path, allow_pickle=False) as z:
        yield z


def read_npy(src: Path | str | bytes) -> np.ndarray:
    """One .npy array from a path or from bytes (a payload), never unpickled."""
    with _HEADERS:
        return np.load(io.BytesIO(src) if isinstance(src, bytes) else src, allow_pickle=False)
